//! The product's nouns, validated when they are built: a `UserId`, a `Tenant`,
//! a `NewMessage` that the store can keep faithfully, a `Timestamp` that
//! always prints with six fractional digits. Nothing here knows HTTP or SQL.

use std::fmt;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::Value;

/// The longest `user_id` accepted, in bytes of UTF-8.
pub const USER_ID_MAX_BYTES: usize = 256;

/// Why a value from the outside was refused; the text is shown to the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// The caller's key for one history: opaque, 1–256 bytes, no control characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UserId(String);

impl UserId {
    pub fn parse(raw: impl Into<String>) -> Result<Self, Invalid> {
        let raw = raw.into();
        if raw.is_empty() {
            return Err(Invalid("user_id must not be empty".into()));
        }
        if raw.len() > USER_ID_MAX_BYTES {
            return Err(Invalid(format!(
                "user_id is {} bytes long; the limit is {USER_ID_MAX_BYTES} bytes of UTF-8",
                raw.len()
            )));
        }
        if let Some(c) = raw.chars().find(|c| c.is_control()) {
            return Err(Invalid(format!(
                "user_id must not contain control characters; found U+{:04X}",
                c as u32
            )));
        }
        Ok(Self(raw))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for UserId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// Whose data a request may see. Every stored row carries one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tenant(String);

impl Tenant {
    /// The tenant of every request while no API keys are configured.
    pub fn default_tenant() -> Self {
        Self("default".into())
    }

    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Server time in whole microseconds since the Unix epoch, UTC: the precision
/// both backends keep, so what is written is what is read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

impl Timestamp {
    pub fn now() -> Self {
        Self(Utc::now().timestamp_micros())
    }

    pub fn from_micros(micros: i64) -> Self {
        Self(micros)
    }

    pub fn as_micros(self) -> i64 {
        self.0
    }

    pub fn to_datetime(self) -> DateTime<Utc> {
        DateTime::from_timestamp_micros(self.0).unwrap_or(DateTime::<Utc>::MIN_UTC)
    }

    pub fn from_datetime(at: DateTime<Utc>) -> Self {
        Self(at.timestamp_micros())
    }

    /// The instant `seconds` before this one, but never before the Unix
    /// epoch: no message is older, and every backend can store that instant.
    pub fn minus_seconds(self, seconds: u64) -> Self {
        let micros = i64::try_from(seconds)
            .unwrap_or(i64::MAX)
            .saturating_mul(1_000_000);
        Self(self.0.saturating_sub(micros).max(0))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            &self
                .to_datetime()
                .to_rfc3339_opts(SecondsFormat::Micros, true),
        )
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A message as the caller wrote it, checked and serialised once: `body` is
/// its JSON text (keys in a canonical order, numbers exactly as written), so
/// two messages are equal JSON values exactly when their bodies are equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMessage {
    role: String,
    body: String,
}

impl NewMessage {
    /// Accepts any JSON object with a non-empty string `role` and no NUL
    /// character anywhere; `at` names the message in error details.
    pub fn from_value(value: Value, at: &str) -> Result<Self, Invalid> {
        let Value::Object(map) = &value else {
            return Err(Invalid(format!(
                "{at} must be a JSON object with a string `role`; got {}",
                json_kind(&value)
            )));
        };
        let role = match map.get("role") {
            Some(Value::String(role)) if !role.is_empty() => role.clone(),
            Some(Value::String(_)) => {
                return Err(Invalid(format!("{at}.role must not be empty")));
            }
            Some(other) => {
                return Err(Invalid(format!(
                    "{at}.role must be a string; got {}",
                    json_kind(other)
                )));
            }
            None => {
                return Err(Invalid(format!(
                    "{at} has no `role`; every message needs a non-empty string role"
                )));
            }
        };
        if let Some(path) = find_nul(&value, at) {
            return Err(Invalid(format!(
                "{path} contains a NUL character (\\u0000), which the store cannot keep faithfully; remove or replace it"
            )));
        }
        let body = serde_json::to_string(&value).map_err(|e| Invalid(e.to_string()))?;
        Ok(Self { role, body })
    }

    /// Rebuilds a message from what a store kept (already validated once).
    pub fn from_stored(role: String, body: String) -> Self {
        Self { role, body }
    }

    pub fn role(&self) -> &str {
        &self.role
    }

    pub fn body(&self) -> &str {
        &self.body
    }
}

/// The `messages` list of a request body, each entry validated.
pub fn parse_message_list(body: Value) -> Result<Vec<NewMessage>, Invalid> {
    let Value::Object(mut top) = body else {
        return Err(Invalid(format!(
            "the body must be a JSON object like {{\"messages\": [...]}}; got {}",
            json_kind(&body)
        )));
    };
    match top.remove("messages") {
        Some(Value::Array(items)) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| NewMessage::from_value(item, &format!("messages[{i}]")))
            .collect(),
        Some(other) => Err(Invalid(format!(
            "`messages` must be a list of message objects; got {}",
            json_kind(&other)
        ))),
        None => Err(Invalid(
            "the body has no `messages` field; send {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}]}"
                .into(),
        )),
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// The JSON path of the first key or string holding a NUL, if any.
fn find_nul(value: &Value, at: &str) -> Option<String> {
    match value {
        Value::String(s) if s.contains('\0') => Some(at.to_string()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| find_nul(item, &format!("{at}[{i}]"))),
        Value::Object(map) => map.iter().find_map(|(key, item)| {
            if key.contains('\0') {
                Some(format!("a key in {at}"))
            } else {
                find_nul(item, &format!("{at}.{key}"))
            }
        }),
        _ => None,
    }
}

/// A message as the store keeps it: the caller's message, verbatim, with what
/// the server adds beside it.
#[derive(Debug, Clone, Serialize)]
pub struct StoredMessage {
    pub seq: i64,
    pub created_at: Timestamp,
    pub message: Box<RawValue>,
}

impl StoredMessage {
    /// `body` is text a store wrote from a `NewMessage`, so it is valid JSON.
    pub fn new(seq: i64, created_at: Timestamp, body: String) -> Result<Self, serde_json::Error> {
        Ok(Self {
            seq,
            created_at,
            message: RawValue::from_string(body)?,
        })
    }

    /// The `role` of the message; `None` only if the stored body lost it.
    pub fn role(&self) -> Option<String> {
        #[derive(serde::Deserialize)]
        struct RoleOnly {
            role: String,
        }
        serde_json::from_str::<RoleOnly>(self.message.get())
            .ok()
            .map(|r| r.role)
    }
}

/// One user's counters and bounds, as `GET /v1/users/{user_id}` reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserStats {
    pub message_count: i64,
    pub first_seq: i64,
    pub last_seq: i64,
    pub oldest_at: Timestamp,
    pub newest_at: Timestamp,
    pub version: i64,
}

/// One row of the user listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserSummary {
    pub user_id: UserId,
    pub message_count: i64,
    pub newest_at: Timestamp,
}

/// Which slice of a history to read. `not_before` is the age cut-off;
/// `after` turns the page forward (oldest first after it), otherwise the
/// page is the newest `limit` messages. Bounds are exclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryQuery {
    pub limit: u32,
    pub not_before: Option<Timestamp>,
    pub before: Option<i64>,
    pub after: Option<i64>,
}

/// A page of history, oldest first, and whether more lies beyond it in the
/// page's direction.
#[derive(Debug, Clone)]
pub struct HistoryPage {
    pub messages: Vec<StoredMessage>,
    pub has_more: bool,
}

impl HistoryPage {
    /// Drops leading messages until the page opens on a `user` message, so a
    /// window never starts on a tool result cut off from its call. What is
    /// dropped from a backward page still lies behind it, hence `has_more`.
    pub fn start_at_user(mut self, paging_forward: bool) -> Self {
        let first_user = self
            .messages
            .iter()
            .position(|m| m.role().as_deref() == Some("user"))
            .unwrap_or(self.messages.len());
        if first_user > 0 {
            self.messages.drain(..first_user);
            if !paging_forward {
                self.has_more = true;
            }
        }
        self
    }
}

/// What an append stored: every message it was given, in order, and the
/// user's version after it.
#[derive(Debug, Clone)]
pub struct Appended {
    pub messages: Vec<StoredMessage>,
    pub version: i64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn user_id_rules() {
        assert!(UserId::parse("+15551234567").is_ok());
        assert!(UserId::parse("whatsapp:+44 20 7946 0958").is_ok());
        assert!(UserId::parse("x".repeat(256)).is_ok());
        assert!(UserId::parse("é".repeat(128)).is_ok());
        assert!(UserId::parse("é".repeat(129)).is_err());
        assert!(UserId::parse("").is_err());
        assert!(UserId::parse("a\tb").is_err());
        assert!(UserId::parse("a\u{7f}").is_err());
        assert!(UserId::parse("a\u{85}").is_err());
        assert!(UserId::parse("a\u{9f}").is_err());
        assert!(UserId::parse("a\u{a0}").is_ok());
    }

    #[test]
    fn timestamps_print_six_fraction_digits_and_z() {
        assert_eq!(
            Timestamp::from_micros(0).to_string(),
            "1970-01-01T00:00:00.000000Z"
        );
        assert_eq!(
            Timestamp::from_micros(1_796_065_200_123_456).to_string(),
            "2026-11-30T19:00:00.123456Z"
        );
    }

    #[test]
    fn minus_seconds_stops_at_the_epoch() {
        let t = Timestamp::from_micros(10_000_000);
        assert_eq!(t.minus_seconds(3).as_micros(), 7_000_000);
        assert_eq!(t.minus_seconds(11).as_micros(), 0);
        assert_eq!(t.minus_seconds(u64::MAX).as_micros(), 0);
    }

    #[test]
    fn messages_need_an_object_with_a_role() {
        assert!(NewMessage::from_value(json!({"role": "user"}), "m").is_ok());
        for bad in [
            json!({"content": "hi"}),
            json!({"role": ""}),
            json!({"role": 3}),
            json!("text"),
            json!(null),
        ] {
            assert!(NewMessage::from_value(bad, "m").is_err());
        }
    }

    #[test]
    fn nul_is_found_in_values_and_keys() {
        let err = NewMessage::from_value(
            json!({"role": "user", "parts": [{"text": "a\u{0}b"}]}),
            "messages[2]",
        )
        .unwrap_err();
        assert!(err
            .0
            .starts_with("messages[2].parts[0].text contains a NUL"));
        let err = NewMessage::from_value(json!({"role": "user", "k\u{0}": 1}), "m").unwrap_err();
        assert!(err.0.contains("a key in m"), "{err}");
    }

    #[test]
    fn big_numbers_keep_every_digit() {
        let value: Value =
            serde_json::from_str(r#"{"role":"user","n":123456789012345678901234567890}"#).unwrap();
        let message = NewMessage::from_value(value, "m").unwrap();
        assert!(message.body().contains("123456789012345678901234567890"));
    }

    #[test]
    fn start_at_user_drops_the_leading_non_user_messages() {
        let stored = |seq, role: &str| {
            StoredMessage::new(
                seq,
                Timestamp::from_micros(0),
                format!(r#"{{"role":"{role}"}}"#),
            )
            .unwrap()
        };
        let page = HistoryPage {
            messages: vec![stored(1, "tool"), stored(2, "assistant"), stored(3, "user")],
            has_more: false,
        };
        let page = page.start_at_user(false);
        assert_eq!(page.messages.len(), 1);
        assert_eq!(page.messages[0].seq, 3);
        assert!(page.has_more);
    }
}
