//! `ApiError`: every failure a client sees, as `application/problem+json`
//! (RFC 9457). A 5xx is logged here with its whole cause chain and reaches
//! the client only as a generic sentence: no SQL, stack or connection string.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::domain::{BodyError, Invalid};
use crate::store::StoreError;
use crate::telemetry::Throttle;

pub const PROBLEM_JSON: &str = "application/problem+json";

/// Seconds a client is asked to wait before retrying a 503.
const RETRY_AFTER_SECONDS: &str = "1";

/// An RFC 9457 problem document; every error response of this API is one.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({
    "type": "about:blank",
    "title": "Unprocessable Entity",
    "status": 422,
    "detail": "messages[0] has no `role`; every message needs a non-empty string role"
}))]
pub struct Problem {
    /// A URI naming the kind of problem; `about:blank` means the status says it all.
    #[serde(rename = "type")]
    pub kind: String,
    /// The HTTP status phrase.
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// What went wrong, in words a person can act on.
    pub detail: String,
}

impl Problem {
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        Self {
            kind: "about:blank".into(),
            title: status.canonical_reason().unwrap_or("Error").into(),
            status: status.as_u16(),
            detail: detail.into(),
        }
    }

    /// The response for this problem, with its content type.
    pub fn into_response_with(self, mut response: Response) -> Response {
        let body = serde_json::to_vec(&self).unwrap_or_default();
        *response.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        response.headers_mut().remove(header::CONTENT_LENGTH);
        *response.body_mut() = body.into();
        response
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        self.into_response_with(Response::default())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{0}")]
    Unprocessable(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ApiError {
    pub fn invalid_parameter(name: &str, why: impl std::fmt::Display) -> Self {
        Self::BadRequest(format!("invalid {name}: {why}"))
    }
}

impl From<BodyError> for ApiError {
    fn from(error: BodyError) -> Self {
        match error {
            BodyError::Malformed(detail) => Self::BadRequest(detail),
            BodyError::Invalid(invalid) => Self::Unprocessable(invalid.0),
            BodyError::TooMany(count) => Self::Unprocessable(format!(
                "`messages` holds {count} messages, more than this operation takes"
            )),
        }
    }
}

impl From<Invalid> for ApiError {
    fn from(invalid: Invalid) -> Self {
        Self::Unprocessable(invalid.0)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, detail) = match self {
            Self::BadRequest(d) => (StatusCode::BAD_REQUEST, d),
            Self::NotFound(d) => (StatusCode::NOT_FOUND, d),
            Self::PayloadTooLarge(d) => (StatusCode::PAYLOAD_TOO_LARGE, d),
            Self::UnsupportedMediaType(d) => (StatusCode::UNSUPPORTED_MEDIA_TYPE, d),
            Self::Unprocessable(d) => (StatusCode::UNPROCESSABLE_ENTITY, d),
            Self::Store(error) => return store_error_response(&error),
        };
        Problem::new(status, detail).into_response()
    }
}

fn store_error_response(error: &StoreError) -> Response {
    match error {
        StoreError::Unavailable(_) | StoreError::Shared(_) | StoreError::NotMigrated { .. } => {
            static UNAVAILABLE: Throttle = Throttle::new();
            if let Some(passed_over) = UNAVAILABLE.admit() {
                tracing::warn!(error = %error_chain(error), passed_over, "database unavailable");
            }
            let mut response = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the database is unavailable right now; retry after the delay in Retry-After \
                 (a write that failed this way may or may not have taken effect: an append \
                 retried with the same Idempotency-Key is stored once)",
            )
            .into_response();
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
            response
        }
        StoreError::Busy(detail) => {
            let mut response =
                Problem::new(StatusCode::SERVICE_UNAVAILABLE, *detail).into_response();
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
            response
        }
        _ => {
            tracing::error!(error = %error_chain(error), "request failed");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the server failed to handle this request; it has been logged",
            )
            .into_response()
        }
    }
}

/// `error: cause: cause…`, for logs.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        // Many errors (sqlx's among them) already print their cause.
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
