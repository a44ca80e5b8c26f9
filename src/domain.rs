//! The product's nouns, validated when they are built: a `UserId`, a `Tenant`,
//! a `NewMessage` that the store can keep faithfully, a `Timestamp` that
//! always prints with six fractional digits. Nothing here knows HTTP or SQL.

use std::fmt;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::Value;
use sha2::{Digest as _, Sha256};

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
/// two messages are equal JSON values exactly when their bodies are equal,
/// and `digest` (SHA-256 of the body, first 16 bytes) stands in for it when
/// a stored transcript is compared with a new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMessage {
    body: String,
    digest: [u8; 16],
}

/// The first 16 bytes of the SHA-256 of `text`.
pub fn digest16(text: &str) -> [u8; 16] {
    let full = Sha256::digest(text.as_bytes());
    let mut short = [0u8; 16];
    short.copy_from_slice(&full[..16]);
    short
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
        match map.get("role") {
            Some(Value::String(role)) if !role.is_empty() => {}
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
        }
        let body = serde_json::to_string(&value).map_err(|e| Invalid(e.to_string()))?;
        // A NUL is written as `\u0000`; only then is the tree walked for its path.
        if body.contains("\\u0000") {
            if let Some(path) = find_nul(&value, at) {
                return Err(Invalid(format!(
                    "{path} contains a NUL character (\\u0000), which the store cannot keep faithfully; remove or replace it"
                )));
            }
        }
        let digest = digest16(&body);
        Ok(Self { body, digest })
    }

    pub fn body(&self) -> &str {
        &self.body
    }

    pub fn digest(&self) -> [u8; 16] {
        self.digest
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

/// The longest `Idempotency-Key` accepted, in characters.
pub const IDEMPOTENCY_KEY_MAX_CHARS: usize = 255;

/// How long an `Idempotency-Key` is remembered, at least.
pub const IDEMPOTENCY_KEY_TTL_SECONDS: u64 = 24 * 60 * 60;

/// A caller's `Idempotency-Key` and the digest of the request it came with:
/// a retry carries the same key and an equal body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idempotency {
    key: String,
    request_digest: [u8; 16],
}

impl Idempotency {
    /// `request` is the whole request body; equal JSON values give equal
    /// digests because it is serialised with keys in canonical order.
    pub fn new(key: &str, request: &Value) -> Result<Self, Invalid> {
        if key.is_empty() {
            return Err(Invalid("Idempotency-Key must not be empty".into()));
        }
        let chars = key.chars().count();
        if chars > IDEMPOTENCY_KEY_MAX_CHARS {
            return Err(Invalid(format!(
                "Idempotency-Key is {chars} characters long; the limit is {IDEMPOTENCY_KEY_MAX_CHARS}"
            )));
        }
        let canonical = serde_json::to_string(request).map_err(|e| Invalid(e.to_string()))?;
        Ok(Self {
            key: key.to_string(),
            request_digest: digest16(&canonical),
        })
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn request_digest(&self) -> [u8; 16] {
        self.request_digest
    }
}

/// How an append with or without an `Idempotency-Key` ended.
#[derive(Debug, Clone)]
pub enum AppendOutcome {
    /// The messages were stored now.
    Stored(Appended),
    /// The key was seen before with an equal body: nothing was stored, and
    /// this is what the first request stored.
    Replayed(Appended),
    /// The key was seen before with a different body.
    KeyReused,
}

/// A whole transcript: the messages verbatim, in order, and the version.
#[derive(Debug)]
pub struct Transcript {
    pub messages: Vec<Box<RawValue>>,
    pub version: i64,
}

/// An `If-Match` precondition on a user's version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IfMatch {
    /// `*`: there must be a transcript.
    Exists,
    /// One or more versions, any of which may be current.
    Versions(Vec<i64>),
}

impl IfMatch {
    /// Parses the header: `*`, or a comma-separated list of strong ETags
    /// like `"17"`. Anything else can never match.
    pub fn parse(header: &str) -> Self {
        if header.trim() == "*" {
            return Self::Exists;
        }
        Self::Versions(
            header
                .split(',')
                .filter_map(|tag| {
                    tag.trim()
                        .strip_prefix('"')?
                        .strip_suffix('"')?
                        .parse::<i64>()
                        .ok()
                })
                .collect(),
        )
    }

    pub fn admits(&self, version: i64, message_count: i64) -> bool {
        match self {
            Self::Exists => message_count > 0,
            Self::Versions(versions) => versions.contains(&version),
        }
    }
}

/// A digest of a whole transcript: of its messages' digests, in order. A
/// save stores it; the next save compares it with the digest of its own
/// first `message_count` messages to learn, without reading them, that it
/// only adds to what is stored.
pub fn transcript_digest(messages: &[NewMessage]) -> [u8; 16] {
    let mut hasher = Sha256::new();
    for message in messages {
        hasher.update(message.digest());
    }
    let mut short = [0u8; 16];
    short.copy_from_slice(&hasher.finalize()[..16]);
    short
}

/// Whether `messages` only adds to what the last save stored: its first
/// `stored` messages digest to `saved` (the digest that save kept), so they
/// need not be read back to be compared.
pub fn extends_saved(saved: Option<&[u8]>, stored: usize, messages: &[NewMessage]) -> bool {
    stored <= messages.len()
        && (stored == 0 || saved == Some(&transcript_digest(&messages[..stored])[..]))
}

/// What replacing a transcript did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Saved {
    pub version: i64,
    /// Messages of the stored transcript left as they were (same `seq`).
    pub kept: u64,
    /// Messages written after the common prefix.
    pub appended: u64,
    /// Messages deleted: those after the common prefix, and any evicted by
    /// `max_messages_per_user`.
    pub removed: u64,
}

/// How a transcript save ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveOutcome {
    Saved(Saved),
    /// `If-Match` named another version; nothing changed.
    PreconditionFailed {
        current_version: i64,
    },
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
    fn if_match_parses_strong_etags() {
        assert_eq!(IfMatch::parse("\"3\""), IfMatch::Versions(vec![3]));
        assert_eq!(
            IfMatch::parse(" \"3\", \"4\" "),
            IfMatch::Versions(vec![3, 4])
        );
        assert_eq!(IfMatch::parse("*"), IfMatch::Exists);
        assert!(!IfMatch::parse("W/\"3\"").admits(3, 1));
        assert!(!IfMatch::parse("3").admits(3, 1));
        assert!(IfMatch::parse("\"0\"").admits(0, 0));
        assert!(!IfMatch::Exists.admits(5, 0));
    }

    #[test]
    fn idempotency_digests_equal_values_equally() {
        let a: Value =
            serde_json::from_str(r#"{"messages":[{"role":"user","a":1,"b":2}]}"#).unwrap();
        let b: Value =
            serde_json::from_str(r#"{ "messages": [ {"b":2, "role":"user", "a":1} ] }"#).unwrap();
        let c: Value =
            serde_json::from_str(r#"{"messages":[{"role":"user","a":1,"b":3}]}"#).unwrap();
        let key = |v: &Value| Idempotency::new("k", v).unwrap().request_digest();
        assert_eq!(key(&a), key(&b));
        assert_ne!(key(&a), key(&c));
        assert!(Idempotency::new(&"k".repeat(255), &a).is_ok());
        assert!(Idempotency::new(&"k".repeat(256), &a).is_err());
        assert!(Idempotency::new("", &a).is_err());
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
