//! `/v1/users/{user_id}/transcript`: a conversation as one document, for
//! agent frameworks that load and save whole transcripts. Saving keeps the
//! longest common prefix with what is stored, so re-saving a long transcript
//! with a few new messages costs about what appending them costs.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use tokio::sync::mpsc;

use super::extract::{user_id, JsonBody, Path, UserPath};
use super::schema::{SaveTranscriptResponse, TranscriptBody, TranscriptResponse};
use super::AppState;
use crate::domain::{BodyError, IfMatch, MessageBody, SaveOutcome, Tenant, Timestamp, UserId};
use crate::error::{error_chain, ApiError, Problem};
use crate::store::{StoreError, TranscriptStream};

fn etag(version: i64) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{version}\"")).expect("digits and quotes are a valid header")
}

/// Load a whole transcript.
///
/// Every message, verbatim and in order (no age window), with the version as
/// `ETag`. 404 when the user has no messages, still with the version as
/// `ETag`, for a save that must not overwrite a transcript created meanwhile.
#[utoipa::path(
    get,
    path = "/v1/users/{user_id}/transcript",
    operation_id = "getTranscript",
    tag = "transcripts",
    params(UserPath),
    responses(
        (status = 200, description = "The transcript", body = TranscriptResponse,
            headers(("ETag" = String, description = "The version, quoted: `\"17\"`"))),
        (status = 400, description = "A bad `user_id`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No transcript: the user has no messages", body = Problem, content_type = "application/problem+json",
            headers(("ETag" = String, description = "The user's version all the same, quoted (`\"0\"` for a user never written): send it as `If-Match` to create the transcript only if nobody else has"))),
    )
)]
pub async fn get_transcript(
    State(state): State<AppState>,
    tenant: Tenant,
    Path(path): Path<UserPath>,
) -> Result<Response, ApiError> {
    let user = user_id(path.user_id)?;
    let stream = state
        .store
        .transcript_stream(&tenant, &user, state.limits.request_timeout)
        .await?;
    let version = stream.version;
    let response = if stream.message_count > 0 {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            transcript_body(&user, stream),
        )
            .into_response()
    } else {
        // Still the version: a save that creates the transcript can name it in
        // If-Match, and so cannot overwrite one another client created first.
        ApiError::NotFound(format!("user {:?} has no transcript", user.as_str())).into_response()
    };
    Ok(([(header::ETAG, etag(version))], response).into_response())
}

/// Bytes of a streamed transcript gathered before they are sent on.
const TRANSCRIPT_CHUNK_BYTES: usize = 32 * 1024;

/// The body `{"user_id":…,"messages":[…],"version":…}`, written as the rows
/// arrive, a chunk of about 32 KiB at a time. A read error (or the store's
/// deadline) ends the body early, so the client sees a broken response
/// rather than a short transcript.
fn transcript_body(user: &UserId, stream: TranscriptStream) -> Body {
    struct Writer {
        rows: mpsc::Receiver<Result<String, StoreError>>,
        head: Option<String>,
        tail: String,
        first: bool,
    }
    let writer = Writer {
        rows: stream.messages,
        head: Some(format!(
            "{{\"user_id\":{},\"messages\":[",
            serde_json::to_string(user.as_str()).unwrap_or_default()
        )),
        tail: format!("],\"version\":{}}}", stream.version),
        first: true,
    };
    let chunks = futures_util::stream::unfold(Some(writer), |writer| async move {
        let mut writer = writer?;
        let mut chunk = writer.head.take().unwrap_or_default();
        let mut next = writer.rows.recv().await;
        loop {
            match next {
                Some(Ok(message)) => {
                    if !writer.first {
                        chunk.push(',');
                    }
                    writer.first = false;
                    chunk.push_str(&message);
                }
                Some(Err(error)) => {
                    tracing::warn!(error = %error_chain(&error), "transcript read ended early");
                    return Some((Err(std::io::Error::other(error)), None));
                }
                None => {
                    chunk.push_str(&writer.tail);
                    return Some((Ok(Bytes::from(chunk)), None));
                }
            }
            if chunk.len() >= TRANSCRIPT_CHUNK_BYTES {
                return Some((Ok(Bytes::from(chunk)), Some(writer)));
            }
            // Wait for a full chunk rather than send the few rows read ahead:
            // one small write per handful of rows costs more than the rows.
            next = writer.rows.recv().await;
        }
    });
    Body::from_stream(chunks)
}

/// Replace a whole transcript.
///
/// Atomic. Messages in the longest common prefix with the stored transcript
/// keep their `seq` and `created_at` and are not rewritten. With
/// `If-Match: "<version>"` the save happens only if the version is current
/// (412 otherwise, and nothing changes). An empty list clears the transcript.
#[utoipa::path(
    put,
    path = "/v1/users/{user_id}/transcript",
    operation_id = "putTranscript",
    tag = "transcripts",
    params(
        UserPath,
        ("If-Match" = Option<String>, Header,
            description = "Save only if the transcript is at this version: an ETag such as `\"17\"` (`\"0\"` for a user never written), or `*` for any existing transcript."),
    ),
    request_body(content = TranscriptBody, content_type = "application/json",
        example = json!({"messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi! How can I help?"}
        ]})),
    responses(
        (status = 200, description = "Saved", body = SaveTranscriptResponse,
            headers(("ETag" = String, description = "The version after the save, quoted"))),
        (status = 400, description = "Malformed JSON or a bad `user_id`", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "`If-Match` names a version that is not current; nothing changed", body = Problem, content_type = "application/problem+json",
            headers(("ETag" = String, description = "The current version, quoted"))),
        (status = 422, description = "Valid JSON that breaks a rule: no `role`, NUL in a string, more messages than `max_transcript_messages`, or a save that would delete more stored messages than that", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn put_transcript(
    State(state): State<AppState>,
    tenant: Tenant,
    Path(path): Path<UserPath>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let user = user_id(path.user_id)?;
    let if_match = headers
        .get(header::IF_MATCH)
        .map(|v| IfMatch::parse(v.to_str().unwrap_or_default()));
    let max = state.limits.max_transcript_messages;
    let messages = MessageBody::parse(&body, max)
        .map_err(|e| match e {
            BodyError::TooMany(count) => ApiError::Unprocessable(format!(
                "`messages` holds {count} messages; a transcript save takes at most {max} \
                 (CHAT_HISTORY_MAX_TRANSCRIPT_MESSAGES): append the rest with POST …/messages"
            )),
            other => other.into(),
        })?
        .messages;
    let outcome = state
        .store
        .save_transcript(
            &tenant,
            &user,
            &messages,
            if_match.as_ref(),
            Timestamp::now(),
            state.limits.max_messages_per_user,
            max,
        )
        .await?;
    match outcome {
        SaveOutcome::Saved(saved) => {
            metrics::counter!("chat_history_messages_appended_total").increment(saved.appended);
            Ok((
                [(header::ETAG, etag(saved.version))],
                Json(SaveTranscriptResponse {
                    user_id: user,
                    version: saved.version,
                    kept: saved.kept,
                    appended: saved.appended,
                    removed: saved.removed,
                }),
            )
                .into_response())
        }
        SaveOutcome::WouldRemove { at_least } => Err(ApiError::Unprocessable(format!(
            "this save would delete at least {at_least} stored messages; one save deletes at most {max} \
             (CHAT_HISTORY_MAX_TRANSCRIPT_MESSAGES): clear the history first \
             (DELETE /v1/users/{{user_id}}, which works in batches), then save"
        ))),
        SaveOutcome::PreconditionFailed { current_version } => {
            let mut response = Problem::new(
                StatusCode::PRECONDITION_FAILED,
                format!(
                    "If-Match does not name the current version of this transcript, which is \"{current_version}\"; load it again, merge, and retry"
                ),
            )
            .into_response();
            response
                .headers_mut()
                .insert(header::ETAG, etag(current_version));
            Ok(response)
        }
    }
}
