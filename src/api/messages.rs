//! `/v1/users/{user_id}/messages`: append to a history and read it back.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};

use super::extract::{page_limit, user_id, JsonBody, Path, Query, UserPath};
use super::schema::{AppendResponse, DeletedResponse, HistoryResponse, MessageBatch};
use super::AppState;
use crate::domain::{
    AppendOutcome, BodyError, HistoryQuery, Idempotency, MessageBody, StoredMessage, Tenant,
    Timestamp,
};
use crate::error::{ApiError, Problem};

const DEFAULT_LIMIT: u32 = 50;

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct MessagePath {
    /// The caller's key for this history: 1–256 bytes of UTF-8, no control
    /// characters, percent-encoded in the URL.
    #[param(
        example = "+15551234567",
        min_length = 1,
        max_length = 256,
        pattern = r"^[^\x00-\x1F\x7F-\x9F]+$"
    )]
    pub(super) user_id: String,
    /// The message's sequence number.
    #[param(value_type = i64, minimum = 1, example = 42)]
    seq: String,
}

impl MessagePath {
    fn seq(&self) -> Result<i64, ApiError> {
        self.seq
            .parse::<i64>()
            .ok()
            .filter(|seq| *seq >= 1)
            .ok_or_else(|| {
                ApiError::invalid_parameter(
                    "seq",
                    format!("{:?} is not a whole number of at least 1", self.seq),
                )
            })
    }
}

/// Only `user` exists: open the window on a user message.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum StartAt {
    User,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct HistoryParams {
    /// How many messages at most. A page also ends early, with `has_more`,
    /// where its messages' bodies reach the server's page size
    /// (`CHAT_HISTORY_MAX_PAGE_BYTES`, 4 MiB unless configured); it always
    /// holds at least one message.
    #[param(minimum = 1, maximum = 1000, default = 50)]
    limit: Option<u32>,
    /// Only messages at most this many seconds old. Omitted: the server's
    /// default window (24 hours unless configured otherwise).
    #[param(minimum = 1, example = 3600)]
    max_age: Option<i64>,
    /// Only messages with a smaller `seq` (page backwards).
    #[param(minimum = 0)]
    before: Option<i64>,
    /// Only messages with a larger `seq`, and the oldest `limit` of them
    /// (page forwards). `after=0` starts at the beginning.
    #[param(minimum = 0)]
    after: Option<i64>,
    /// `user`: drop leading messages until the window opens on a `user`
    /// message, so it never starts on a tool result cut off from its call.
    #[param(inline)]
    start: Option<StartAt>,
}

impl HistoryParams {
    fn to_query(&self, now: Timestamp, state: &AppState) -> Result<HistoryQuery, ApiError> {
        let limit = page_limit(self.limit, DEFAULT_LIMIT)?;
        let max_age = match self.max_age {
            Some(seconds) if seconds < 1 => {
                return Err(ApiError::invalid_parameter(
                    "max_age",
                    "must be at least 1 (seconds)",
                ))
            }
            Some(seconds) => Some(seconds.unsigned_abs()),
            None => state.limits.default_window.map(|w| w.as_secs().max(1)),
        };
        for (name, bound) in [("before", self.before), ("after", self.after)] {
            if bound.is_some_and(|seq| seq < 0) {
                return Err(ApiError::invalid_parameter(
                    name,
                    "must be a sequence number of 0 or more",
                ));
            }
        }
        Ok(HistoryQuery {
            limit,
            not_before: max_age.map(|seconds| now.minus_seconds(seconds)),
            before: self.before,
            after: self.after,
        })
    }
}

/// The header that makes an append safe to retry.
const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set on a 201 that replays an earlier append with the same key.
const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Append messages to a user's history.
///
/// Appends 1..`max_batch` messages atomically and in order. Each gets the
/// next `seq` of this user and the server's `created_at`. With an
/// `Idempotency-Key`, a retry with the same key and an equal body returns the
/// first response (and `Idempotent-Replayed: true`) and stores nothing.
#[utoipa::path(
    post,
    path = "/v1/users/{user_id}/messages",
    operation_id = "appendMessages",
    tag = "messages",
    params(
        UserPath,
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255,
            pattern = r"^[\x21-\x7E]([\x20-\x7E]*[\x21-\x7E])?$",
            description = "Makes the append safe to retry: the same key with an equal body returns the first response and stores nothing; with another body it is a 422. Kept at least 24 hours, per user."),
    ),
    request_body(content = MessageBatch, content_type = "application/json",
        example = json!({"messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}
        ]})),
    responses(
        (status = 201, description = "Stored, in order", body = AppendResponse,
            headers(("Idempotent-Replayed" = String, description = "`true` when this replays an earlier append with the same Idempotency-Key"))),
        (status = 400, description = "Malformed JSON, a bad `user_id` or a bad Idempotency-Key", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Valid JSON that breaks a rule: no `role`, empty batch, batch over `max_batch`, NUL in a string, Idempotency-Key reused with another body", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn append_messages(
    State(state): State<AppState>,
    tenant: Tenant,
    Path(path): Path<UserPath>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let user = user_id(path.user_id)?;
    let key = match headers.get(IDEMPOTENCY_KEY) {
        None => None,
        Some(value) => {
            // Visible ASCII and spaces: what the documented pattern admits
            // (`to_str` would also pass a tab).
            let key = value
                .to_str()
                .ok()
                .filter(|key| !key.contains('\t'))
                .ok_or_else(|| {
                    ApiError::invalid_parameter(
                        "Idempotency-Key",
                        "use visible ASCII characters and spaces only",
                    )
                })?;
            Idempotency::check_key(key)
                .map_err(|e| ApiError::invalid_parameter("Idempotency-Key", e))?;
            Some(key)
        }
    };
    let max_batch = state.limits.max_batch;
    let body = MessageBody::parse(&body, max_batch).map_err(|e| match e {
        BodyError::TooMany(count) => ApiError::Unprocessable(format!(
            "`messages` holds {count} messages; one append takes at most {max_batch} (max_batch), so split it"
        )),
        other => other.into(),
    })?;
    let idempotency = key
        .map(|key| Idempotency::new(key, body.digest))
        .transpose()
        .map_err(|e| ApiError::invalid_parameter("Idempotency-Key", e))?;
    let messages = body.messages;
    if messages.is_empty() {
        return Err(ApiError::Unprocessable(
            "`messages` is empty; send at least one message".into(),
        ));
    }
    let outcome = state
        .store
        .append_messages(
            &tenant,
            &user,
            &messages,
            Timestamp::now(),
            state.limits.max_messages_per_user,
            idempotency.as_ref(),
        )
        .await?;
    let (appended, replayed) = match outcome {
        AppendOutcome::Stored(appended) => {
            metrics::counter!("chat_history_messages_appended_total")
                .increment(appended.messages.len() as u64);
            (appended, false)
        }
        AppendOutcome::Replayed(appended) => (appended, true),
        AppendOutcome::KeyReused => {
            return Err(ApiError::Unprocessable(
                "this Idempotency-Key was already used with a different body for this user; use a new key for a new request"
                    .into(),
            ))
        }
    };
    let mut response = (
        StatusCode::CREATED,
        Json(AppendResponse {
            user_id: user,
            messages: appended.messages,
            version: appended.version,
        }),
    )
        .into_response();
    if replayed {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(response)
}

/// Read a user's recent history.
///
/// Without `after`: the most recent `limit` messages that pass the age
/// filter. With `after`: the oldest `limit` messages after it. Always oldest
/// first. An unknown user has an empty history.
#[utoipa::path(
    get,
    path = "/v1/users/{user_id}/messages",
    operation_id = "getHistory",
    tag = "messages",
    params(UserPath, HistoryParams),
    responses(
        (status = 200, description = "A page of history, oldest first", body = HistoryResponse),
        (status = 400, description = "A bad `user_id` or query parameter", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn get_history(
    State(state): State<AppState>,
    tenant: Tenant,
    Path(path): Path<UserPath>,
    Query(params): Query<HistoryParams>,
) -> Result<Json<HistoryResponse>, ApiError> {
    let user = user_id(path.user_id)?;
    let query = params.to_query(Timestamp::now(), &state)?;
    let mut page = state.store.history_window(&tenant, &user, query).await?;
    if let Some(StartAt::User) = params.start {
        page = page.start_at_user(query.after.is_some());
    }
    Ok(Json(HistoryResponse {
        user_id: user,
        messages: page.messages,
        has_more: page.has_more,
    }))
}

/// Read one message.
#[utoipa::path(
    get,
    path = "/v1/users/{user_id}/messages/{seq}",
    operation_id = "getMessage",
    tag = "messages",
    params(MessagePath),
    responses(
        (status = 200, description = "The message", body = super::schema::StoredMessageSchema),
        (status = 400, description = "A bad `user_id` or `seq`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No message with this `seq`", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn get_message(
    State(state): State<AppState>,
    tenant: Tenant,
    Path(path): Path<MessagePath>,
) -> Result<Json<StoredMessage>, ApiError> {
    let seq = path.seq()?;
    let user = user_id(path.user_id)?;
    state
        .store
        .message(&tenant, &user, seq)
        .await?
        .map(Json)
        .ok_or_else(|| {
            ApiError::NotFound(format!(
                "user {:?} has no message with seq {seq}",
                user.as_str()
            ))
        })
}

/// Delete one message, for example a bad tool output.
#[utoipa::path(
    delete,
    path = "/v1/users/{user_id}/messages/{seq}",
    operation_id = "deleteMessage",
    tag = "messages",
    params(MessagePath),
    responses(
        (status = 200, description = "Deleted", body = DeletedResponse),
        (status = 400, description = "A bad `user_id` or `seq`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No message with this `seq`", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn delete_message(
    State(state): State<AppState>,
    tenant: Tenant,
    Path(path): Path<MessagePath>,
) -> Result<Json<DeletedResponse>, ApiError> {
    let seq = path.seq()?;
    let user = user_id(path.user_id)?;
    if state.store.delete_message(&tenant, &user, seq).await? {
        Ok(Json(DeletedResponse { deleted: 1 }))
    } else {
        Err(ApiError::NotFound(format!(
            "user {:?} has no message with seq {seq}",
            user.as_str()
        )))
    }
}
