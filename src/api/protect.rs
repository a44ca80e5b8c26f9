//! What keeps one caller from exhausting the service for the others: a cap
//! on `/v1` requests in flight, a budget for the bytes of the bodies in
//! flight, those of requests and of large answers alike (shed with 503 and
//! `Retry-After`, never queued), and panics answered as a problem+json 500
//! with a log line instead of a dropped connection.

use std::any::Any;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit};

use crate::config::Limits;
use crate::error::Problem;

/// The shared budgets of all requests in flight.
pub struct Budgets {
    requests: Semaphore,
    /// Body bytes, counted in KiB so that one request fits a `u32` of permits.
    body_kib: Arc<Semaphore>,
    /// All of `body_kib`: what the largest answer reserves.
    total_kib: usize,
    max_body_bytes: usize,
}

/// An answer up to this size is sent without a reservation: nearly all
/// answers are far smaller, and they never touch the budget's semaphore.
const UNRESERVED_ANSWER_BYTES: u64 = 64 * 1024;

/// A reserved answer is handed to hyper in copies of this size, so that
/// once its reservation is given back, what hyper still holds for a slow
/// client is its write buffer (about 400 KiB), not the whole answer.
const ANSWER_CHUNK_BYTES: usize = 64 * 1024;

impl Budgets {
    pub fn new(limits: &Limits) -> Self {
        let total_kib = limits.max_in_flight_body_bytes.div_ceil(1024);
        Self {
            requests: Semaphore::new(limits.max_in_flight),
            body_kib: Arc::new(Semaphore::new(total_kib)),
            total_kib,
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
/// requests in flight and its body's share of their bytes. `budgets` is
/// `None` for the operational endpoints, which are never shed.
pub struct Admitted<'a> {
    budgets: Option<&'a Budgets>,
    safe: bool,
    _slot: Option<SemaphorePermit<'a>>,
    body: Option<OwnedSemaphorePermit>,
}

impl Admitted<'_> {
    /// Gives back the request's place, and makes a large answer hold its
    /// bytes in the in-flight body budget until the client has taken its
    /// last byte: a page of history, a message or an append's echo can be
    /// megabytes, and a client that reads slowly (or not at all) would
    /// otherwise hold them out of any count. The answer keeps what the
    /// request's body reserved and takes only the rest. When the budget has
    /// no room for that rest, the answer to a read is dropped for a 503 with
    /// `Retry-After`, as a request body would be; the answer to a write,
    /// whose work is done, is sent with what it holds.
    pub async fn hold_answer(self, response: Response) -> Response {
        let Some(budgets) = self.budgets else {
            return response;
        };
        let Some(bytes) = response
            .body()
            .size_hint()
            .exact()
            .filter(|bytes| *bytes > UNRESERVED_ANSWER_BYTES)
        else {
            return response;
        };
        // An answer larger than the whole budget takes all of it.
        let kib = usize::try_from(bytes.div_ceil(1024))
            .unwrap_or(usize::MAX)
            .min(budgets.total_kib);
        let held = self
            .body
            .as_ref()
            .map_or(0, OwnedSemaphorePermit::num_permits);
        let reserved = if kib <= held {
            self.body.and_then(|mut body| body.split(kib))
        } else {
            let more = u32::try_from(kib - held).unwrap_or(u32::MAX);
            match (
                budgets.body_kib.clone().try_acquire_many_owned(more),
                self.body,
            ) {
                (Ok(more), None) => Some(more),
                (Ok(more), Some(mut body)) => {
                    body.merge(more);
                    Some(body)
                }
                (Err(_), body) if !self.safe => body,
                (Err(_), _) => {
                    metrics::counter!("chat_history_requests_shed_total", "reason" => "answer_bytes")
                        .increment(1);
                    return busy(
                        "the answers and request bodies in flight fill this server's budget (CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES); retry after the delay in Retry-After",
                    );
                }
            }
        };
        let (parts, body) = response.into_parts();
        match axum::body::to_bytes(body, usize::MAX).await {
            Ok(bytes) => Response::from_parts(
                parts,
                Body::new(HeldAnswer {
                    bytes,
                    sent: 0,
                    _reserved: reserved,
                }),
            ),
            Err(e) => {
                tracing::error!("an answer's body failed before it was sent: {e}");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the server failed to produce this answer; it has been logged",
                )
                .into_response()
            }
        }
    }
}

/// An answer that holds its share of the in-flight body budget until hyper
/// has taken its last byte (or the connection is gone), handed over in
/// copies of [`ANSWER_CHUNK_BYTES`] so that hyper takes the next one only
/// once it has written out what it holds.
struct HeldAnswer {
    bytes: Bytes,
    sent: usize,
    _reserved: Option<OwnedSemaphorePermit>,
}

impl HttpBody for HeldAnswer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let rest = &this.bytes[this.sent..];
        if rest.is_empty() {
            return Poll::Ready(None);
        }
        let chunk = Bytes::copy_from_slice(&rest[..rest.len().min(ANSWER_CHUNK_BYTES)]);
        this.sent += chunk.len();
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.sent == self.bytes.len()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact((self.bytes.len() - self.sent) as u64)
    }
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
                budgets: None,
                safe: true,
                _slot: None,
                body: None,
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
            match self.body_kib.clone().try_acquire_many_owned(kib) {
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
            budgets: Some(self),
            safe: request.method().is_safe(),
            _slot: Some(slot),
            body,
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
