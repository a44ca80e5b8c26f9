//! What keeps one caller from exhausting the service for the others: a cap
//! on `/v1` requests in flight, a budget for the bytes of the bodies in
//! flight (shed with 503 and `Retry-After`, never queued), and panics
//! answered as a problem+json 500 with a log line instead of a dropped
//! connection.

use std::any::Any;

use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::config::Limits;
use crate::error::Problem;

/// The shared budgets of all requests in flight.
pub struct Budgets {
    requests: Semaphore,
    /// Body bytes, counted in KiB so that one request fits a `u32` of permits.
    body_kib: Semaphore,
    max_body_bytes: usize,
}

impl Budgets {
    pub fn new(limits: &Limits) -> Self {
        Self {
            requests: Semaphore::new(limits.max_in_flight),
            body_kib: Semaphore::new(limits.max_in_flight_body_bytes.div_ceil(1024)),
            max_body_bytes: limits.max_body_bytes,
        }
    }

    /// What a request's body may take, in KiB: its `Content-Length`, or the
    /// largest body allowed when it streams one without saying how long.
    /// A body declared over the limit is refused (413) before it is read.
    fn body_kib(&self, headers: &HeaderMap) -> u32 {
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        let bytes = match declared {
            Some(n) if n > self.max_body_bytes => 0,
            Some(n) => n,
            None if headers.contains_key(header::TRANSFER_ENCODING) => self.max_body_bytes,
            None => 0,
        };
        u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
    }
}

/// What a request admitted holds until it is answered: its place among the
/// requests in flight and its body's share of their bytes.
pub struct Admitted<'a> {
    _slot: Option<SemaphorePermit<'a>>,
    _body: Option<SemaphorePermit<'a>>,
}

impl Budgets {
    /// Admits a `/v1` request only while there is room for it among the
    /// requests in flight and for its body among theirs; otherwise the
    /// `Err` is a 503 to answer at once (boxed: it is rare, and a
    /// `Response` is large). The operational endpoints are never shed, so
    /// probes keep answering.
    pub fn admit(&self, request: &Request) -> Result<Admitted<'_>, Box<Response>> {
        if !request.uri().path().starts_with("/v1") {
            return Ok(Admitted {
                _slot: None,
                _body: None,
            });
        }
        let Ok(slot) = self.requests.try_acquire() else {
            metrics::counter!("chat_history_requests_shed_total", "reason" => "in_flight")
                .increment(1);
            return Err(Box::new(busy(
                "this server is handling as many requests as it accepts (CHAT_HISTORY_MAX_IN_FLIGHT); retry after the delay in Retry-After",
            )));
        };
        let kib = self.body_kib(request.headers());
        let body = if kib == 0 {
            None
        } else {
            match self.body_kib.try_acquire_many(kib) {
                Ok(reserved) => Some(reserved),
                Err(_) => {
                    metrics::counter!("chat_history_requests_shed_total", "reason" => "body_bytes")
                        .increment(1);
                    return Err(Box::new(busy(
                        "the bodies of the requests in flight fill this server's budget (CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES); retry after the delay in Retry-After",
                    )));
                }
            }
        };
        Ok(Admitted {
            _slot: Some(slot),
            _body: body,
        })
    }
}

fn busy(detail: &str) -> Response {
    let mut response = Problem::new(StatusCode::SERVICE_UNAVAILABLE, detail).into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// The answer to a handler that panicked: the panic is logged, the client
/// gets a 500 that says nothing of it.
pub fn panic_response(panic: Box<dyn Any + Send + 'static>) -> Response {
    let message = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("a panic with no message");
    tracing::error!(panic = message, "a request handler panicked");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the server failed to handle this request; it has been logged",
    )
    .into_response()
}
