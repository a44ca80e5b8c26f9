//! Extractors whose failures are `ApiError`s, so that a bad query string,
//! path or body gets a problem+json answer that says what to fix.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::{header, request::Parts, StatusCode};
use axum::response::Response;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use utoipa::IntoParams;

use super::AppState;
use crate::auth::{self, Verified};
use crate::domain::{Tenant, UserId};
use crate::error::ApiError;

/// `axum::extract::Query` with a 400 problem as its rejection.
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Self(q.0))
            .map_err(|rejection| ApiError::BadRequest(rejection.body_text()))
    }
}

/// `axum::extract::Path` with a 400 problem as its rejection.
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Self(p.0))
            .map_err(|rejection| ApiError::BadRequest(rejection.body_text()))
    }
}

/// The tenant the request acts for. With no keys configured that is the
/// default tenant; with keys, only the tenant that access control verified
/// and put in the request: a handler reached any other way gets a 401, never
/// the default tenant's data.
impl FromRequestParts<AppState> for Tenant {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Response> {
        if state.access.is_open() {
            return Ok(Tenant::default_tenant());
        }
        parts
            .extensions
            .get::<Verified>()
            .map(|verified| verified.0.clone())
            .ok_or_else(auth::unauthorized)
    }
}

/// A JSON request body, as bytes: 415 unless the content type is JSON, 413
/// over the body limit. The handler parses it into the type it needs, so no
/// generic tree of the whole body is ever built.
pub struct JsonBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !has_json_content_type(req.headers()) {
            return Err(ApiError::UnsupportedMediaType(
                "send the body as JSON with `Content-Type: application/json`".into(),
            ));
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge(
                    "the body is larger than this server accepts (max_body_bytes); send fewer messages per request".into(),
                )
            } else {
                ApiError::BadRequest(rejection.body_text())
            }
        })?;
        Ok(Self(bytes))
    }
}

/// `application/json`, or any `application/…+json`, parameters ignored.
fn has_json_content_type(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    match essence.split_once('/') {
        Some(("application", subtype)) => subtype == "json" || subtype.ends_with("+json"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::has_json_content_type;
    use axum::http::{header, HeaderMap, HeaderValue};

    fn with(content_type: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        headers
    }

    #[test]
    fn json_content_types() {
        assert!(has_json_content_type(&with("application/json")));
        assert!(has_json_content_type(&with(
            "Application/JSON; charset=utf-8"
        )));
        assert!(has_json_content_type(&with("application/merge-patch+json")));
        assert!(!has_json_content_type(&with("text/plain")));
        assert!(!has_json_content_type(&with("application/jsonx")));
        assert!(!has_json_content_type(&HeaderMap::new()));
    }
}

/// The `{user_id}` of every per-user path.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct UserPath {
    /// The caller's key for this history: 1–256 bytes of UTF-8, no control
    /// characters, percent-encoded in the URL.
    #[param(
        example = "+15551234567",
        min_length = 1,
        max_length = 256,
        pattern = r"^[^\x00-\x1F\x7F-\x9F]+$"
    )]
    pub(super) user_id: String,
}

/// A `user_id` from the path, or a 400 that says what is wrong with it.
pub(super) fn user_id(raw: String) -> Result<UserId, ApiError> {
    UserId::parse(raw).map_err(|e| ApiError::invalid_parameter("user_id", e))
}

/// The most items one page (a history read, a list of users) holds; the
/// OpenAPI document says the same (`maximum = 1000` on each `limit`).
pub(super) const MAX_PAGE_LIMIT: u32 = 1000;

/// A page's `limit` parameter, `default` when absent, or a 400 naming it.
pub(super) fn page_limit(limit: Option<u32>, default: u32) -> Result<u32, ApiError> {
    let limit = limit.unwrap_or(default);
    if (1..=MAX_PAGE_LIMIT).contains(&limit) {
        Ok(limit)
    } else {
        Err(ApiError::invalid_parameter(
            "limit",
            format!("must be between 1 and {MAX_PAGE_LIMIT}; got {limit}"),
        ))
    }
}
