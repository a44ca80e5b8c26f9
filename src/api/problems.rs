//! The middleware that turns the bare error responses of axum and of tower
//! layers (unknown route, wrong method, request timeout) into problem+json.

use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use crate::error::{Problem, PROBLEM_JSON};

/// Gives a problem+json body to error responses that axum or a layer made
/// bare (unknown route, wrong method, …), keeping their headers (`Allow`).
pub(super) async fn problem_for_bare_errors(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    let status = response.status();
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(PROBLEM_JSON.as_bytes()));
    if !(status.is_client_error() || status.is_server_error()) || is_problem {
        return response;
    }
    let detail = match status {
        StatusCode::NOT_FOUND => {
            format!("nothing lives at {path}; the API is under /v1 and described at /openapi.json")
        }
        StatusCode::SERVICE_UNAVAILABLE if is_write(&method) => {
            "the request took longer than this server allows (CHAT_HISTORY_REQUEST_TIMEOUT), so \
             whether it took effect is unknown; retrying is safe: an append with the same \
             Idempotency-Key is stored once, and saves and deletes are idempotent"
                .into()
        }
        StatusCode::SERVICE_UNAVAILABLE => {
            "the request took longer than this server allows (CHAT_HISTORY_REQUEST_TIMEOUT); retry later".into()
        }
        StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = response
                .headers()
                .get(header::ALLOW)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            format!("{method} is not allowed on {path}; allowed: {allowed}")
        }
        other => other.canonical_reason().unwrap_or("error").to_string(),
    };
    let mut response = Problem::new(status, detail).into_response_with(response);
    if status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .entry(header::RETRY_AFTER)
            .or_insert(HeaderValue::from_static("1"));
    }
    response
}

/// Whether `method` changes data.
fn is_write(method: &Method) -> bool {
    !(method.is_safe() || method == Method::OPTIONS)
}
