//! Request and response bodies as the OpenAPI document describes them.
//! `Message` is any JSON object with a string `role`; the server never looks
//! inside it beyond that, and returns it as it was written.

use serde::{Deserialize, Serialize};
use utoipa::openapi::schema::{AdditionalProperties, ObjectBuilder, Schema, Type};
use utoipa::openapi::RefOr;
use utoipa::{PartialSchema, ToSchema};

use crate::domain::{StoredMessage, Timestamp, UserId};

/// A chat message: a JSON object with a non-empty string `role`. Every other
/// field (`content`, `name`, `tool_calls`, `tool_call_id`, `metadata`, …) is
/// kept and returned unchanged.
pub enum Message {}

impl PartialSchema for Message {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .description(Some(
                "A chat message: any JSON object with a non-empty string `role`. \
                 Every other field is stored and returned unchanged.",
            ))
            .property(
                "role",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .min_length(Some(1))
                    .description(Some(
                        "`user`, `assistant`, `system`, `tool`, or any other role",
                    )),
            )
            .required("role")
            .additional_properties(Some(AdditionalProperties::FreeForm(true)))
            .examples([
                serde_json::json!({"role": "user", "content": "What is the weather in Paris?"}),
            ])
            .into()
    }
}

impl ToSchema for Message {}

/// A message as stored: the caller's message verbatim, with `seq` and
/// `created_at` beside it.
#[derive(ToSchema)]
#[schema(as = StoredMessage)]
pub struct StoredMessageSchema {
    /// Per user, strictly increasing in commit order, never reused; starts at 1.
    #[schema(minimum = 1, example = 42)]
    pub seq: i64,
    /// Server time, UTC, RFC 3339 with exactly six fractional digits.
    #[schema(value_type = String, format = DateTime, example = "2026-11-30T19:00:00.123456Z")]
    pub created_at: String,
    pub message: Message,
}

/// `{"messages": [...]}`: the body of an append.
#[derive(ToSchema)]
pub struct MessageBatch {
    /// One or more messages, stored in this order.
    #[schema(min_items = 1)]
    pub messages: Vec<Message>,
}

/// What an append stored.
#[derive(Serialize, ToSchema)]
pub struct AppendResponse {
    #[schema(value_type = String, example = "+15551234567")]
    pub user_id: UserId,
    /// Every message the request appended, in order.
    #[schema(value_type = Vec<StoredMessageSchema>)]
    pub messages: Vec<StoredMessage>,
    /// The user's version after this write.
    #[schema(example = 17)]
    pub version: i64,
}

/// A page of history, oldest first.
#[derive(Serialize, ToSchema)]
pub struct HistoryResponse {
    #[schema(value_type = String, example = "+15551234567")]
    pub user_id: UserId,
    #[schema(value_type = Vec<StoredMessageSchema>)]
    pub messages: Vec<StoredMessage>,
    /// More messages passing the same filters lie beyond this page, in its
    /// direction: older ones without `after`, newer ones with it.
    #[schema(example = false)]
    pub has_more: bool,
}

/// How many messages a delete removed.
#[derive(Serialize, ToSchema)]
pub struct DeletedResponse {
    #[schema(example = 12)]
    pub deleted: u64,
}

/// One user's history at a glance.
#[derive(Serialize, ToSchema)]
pub struct UserStatsResponse {
    #[schema(value_type = String, example = "+15551234567")]
    pub user_id: UserId,
    #[schema(example = 12)]
    pub message_count: i64,
    #[schema(example = 31)]
    pub first_seq: i64,
    #[schema(example = 42)]
    pub last_seq: i64,
    #[schema(value_type = String, format = DateTime, example = "2026-11-30T18:00:00.000000Z")]
    pub oldest_at: Timestamp,
    #[schema(value_type = String, format = DateTime, example = "2026-11-30T19:00:00.123456Z")]
    pub newest_at: Timestamp,
    /// Changes on every write to this user; never repeats.
    #[schema(example = 17)]
    pub version: i64,
}

/// A user that has messages.
#[derive(Serialize, ToSchema)]
pub struct UserSummaryResponse {
    #[schema(value_type = String, example = "+15551234567")]
    pub user_id: UserId,
    #[schema(example = 12)]
    pub message_count: i64,
    #[schema(value_type = String, format = DateTime, example = "2026-11-30T19:00:00.123456Z")]
    pub newest_at: Timestamp,
}

/// A page of users, ordered by the bytes of `user_id`.
#[derive(Serialize, ToSchema)]
pub struct UserListResponse {
    pub users: Vec<UserSummaryResponse>,
    /// More users follow; ask again with `after` set to the last `user_id`.
    #[schema(example = false)]
    pub has_more: bool,
}

/// The answer of `/healthz` and `/readyz`.
#[derive(Serialize, ToSchema)]
pub struct StatusResponse {
    #[schema(example = "ok")]
    pub status: &'static str,
}

/// A whole transcript: the messages exactly as written, in order.
#[derive(Serialize, ToSchema)]
pub struct TranscriptResponse {
    #[schema(value_type = String, example = "session-42")]
    pub user_id: UserId,
    #[schema(value_type = Vec<Message>)]
    pub messages: Vec<Box<serde_json::value::RawValue>>,
    /// The version this transcript is at; also the `ETag`.
    #[schema(example = 17)]
    pub version: i64,
}

/// `{"messages": [...]}`: the whole transcript to save; an empty list clears it.
#[derive(ToSchema)]
pub struct TranscriptBody {
    pub messages: Vec<Message>,
}

/// What saving a transcript did.
#[derive(Serialize, ToSchema)]
pub struct SaveTranscriptResponse {
    #[schema(value_type = String, example = "session-42")]
    pub user_id: UserId,
    /// The version after the save (unchanged when nothing changed); also the `ETag`.
    #[schema(example = 18)]
    pub version: i64,
    /// Messages of the common prefix, left untouched (same `seq` and `created_at`).
    #[schema(example = 1000)]
    pub kept: u64,
    /// Messages written after the common prefix.
    #[schema(example = 2)]
    pub appended: u64,
    /// Stored messages deleted: those after the common prefix, and any evicted
    /// by `max_messages_per_user`.
    #[schema(example = 0)]
    pub removed: u64,
}

/// `POST /v1/admin/purge-expired`.
// One type parses the body and documents it; other fields are ignored.
#[derive(Deserialize, ToSchema)]
pub struct PurgeExpiredRequest {
    /// Delete every message older than this many seconds.
    #[schema(value_type = u64, minimum = 1, example = 2592000)]
    pub max_age: serde_json::Number,
}

impl PurgeExpiredRequest {
    /// `max_age` as a whole number of seconds from 1 to `i64::MAX`, the
    /// documented `int64`. As in JSON Schema, `3600.0` is the integer 3600.
    pub fn max_age(&self) -> Option<u64> {
        const BEYOND_I64: f64 = 9_223_372_036_854_775_808.0;
        let n = &self.max_age;
        let seconds = match n.as_i64() {
            Some(seconds) => u64::try_from(seconds).ok()?,
            None => {
                let seconds = n.as_f64()?;
                if seconds.fract() != 0.0 || !(0.0..BEYOND_I64).contains(&seconds) {
                    return None;
                }
                // A whole number below 2^63: its shortest decimal form is exact.
                format!("{seconds:.0}").parse::<u64>().ok()?
            }
        };
        Some(seconds).filter(|seconds| *seconds >= 1)
    }
}

/// `POST /v1/admin/clear-all`.
// One type parses the body and documents it.
#[derive(Deserialize, ToSchema)]
pub struct ClearAllRequest {
    /// Must be `true`: this deletes every message.
    #[schema(schema_with = only_true)]
    pub confirm: bool,
}

/// A boolean that admits one value, `true`: the request's own confirmation.
fn only_true() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::Type::Boolean)
        .enum_values(Some([true]))
        .description(Some("Must be `true`: this deletes every message."))
        .examples([true])
        .build()
}
