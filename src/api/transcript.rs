//! `/v1/users/{user_id}/transcript`: a conversation as one document, for
//! agent frameworks that load and save whole transcripts. Saving keeps the
//! longest common prefix with what is stored, so re-saving a long transcript
//! with a few new messages costs about what appending them costs.

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::extract::{JsonBody, Path};
use super::messages::UserPath;
use super::schema::{SaveTranscriptResponse, TranscriptBody, TranscriptResponse};
use super::{user_id, AppState};
use crate::domain::{parse_message_list, IfMatch, SaveOutcome, Tenant, Timestamp};
use crate::error::{ApiError, Problem};

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
    let transcript = state.store.transcript(&tenant, &user).await?;
    let version = transcript.as_ref().map_or(0, |t| t.version);
    let response = match transcript {
        Some(transcript) if !transcript.messages.is_empty() => Json(TranscriptResponse {
            user_id: user,
            messages: transcript.messages,
            version,
        })
        .into_response(),
        // Still the version: a save that creates the transcript can name it in
        // If-Match, and so cannot overwrite one another client created first.
        _ => ApiError::NotFound(format!("user {:?} has no transcript", user.as_str()))
            .into_response(),
    };
    Ok(([(header::ETAG, etag(version))], response).into_response())
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
        (status = 422, description = "Valid JSON that breaks a rule: no `role`, NUL in a string", body = Problem, content_type = "application/problem+json"),
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
    let messages = parse_message_list(body)?;
    let outcome = state
        .store
        .save_transcript(
            &tenant,
            &user,
            &messages,
            if_match.as_ref(),
            Timestamp::now(),
            state.limits.max_messages_per_user,
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
