//! The product's nouns, validated when they are built: a `UserId`, a `Tenant`,
//! a `NewMessage` that the store can keep faithfully, a `Timestamp` that
//! always prints with six fractional digits. Nothing here knows HTTP or SQL.

use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::ser::Error as _;
use serde::{Serialize, Serializer};
use serde_json::value::RawValue;
use sha2::{Digest as _, Sha256};

use crate::canonical::{self, CanonicalError, JsonPath};

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

impl Timestamp {
    /// `YYYY-MM-DDTHH:MM:SS.ffffffZ`, written digit by digit: every message
    /// a read returns carries one, and chrono's formatter cost a twentieth
    /// of a read. `None` outside the years 1970 to 9999.
    fn rfc3339(self) -> Option<[u8; 27]> {
        let micros = u64::try_from(self.0).ok()?;
        let (seconds, fraction) = (micros / 1_000_000, micros % 1_000_000);
        let (days, second_of_day) = (seconds / 86_400, seconds % 86_400);
        let (year, month, day) = civil_from_days(days);
        if year > 9999 {
            return None;
        }
        let mut out = *b"0000-00-00T00:00:00.000000Z";
        let mut put = |at: usize, width: usize, mut value: u64| {
            for i in (at..at + width).rev() {
                out[i] = b'0' + (value % 10) as u8;
                value /= 10;
            }
        };
        put(0, 4, year);
        put(5, 2, month);
        put(8, 2, day);
        put(11, 2, second_of_day / 3600);
        put(14, 2, second_of_day / 60 % 60);
        put(17, 2, second_of_day % 60);
        put(20, 6, fraction);
        Some(out)
    }
}

/// The proleptic Gregorian (year, month, day) of a day count since
/// 1970-01-01 (Howard Hinnant's `civil_from_days`, for days ≥ 0).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rfc3339() {
            // Only ASCII digits and punctuation were written.
            Some(text) => f.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?),
            None => f.write_str(
                &self
                    .to_datetime()
                    .to_rfc3339_opts(SecondsFormat::Micros, true),
            ),
        }
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.rfc3339() {
            Some(text) => s.serialize_str(std::str::from_utf8(&text).map_err(S::Error::custom)?),
            None => s.collect_str(self),
        }
    }
}

/// An RFC 3339 time, as `Timestamp` serializes (exports carry them).
impl<'de> serde::Deserialize<'de> for Timestamp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        DateTime::parse_from_rfc3339(&text)
            .map(|at| Self::from_datetime(at.to_utc()))
            .map_err(|e| serde::de::Error::custom(format!("{text:?} is not an RFC 3339 time: {e}")))
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
    pub fn from_raw(raw: &RawValue, at: &str) -> Result<Self, BodyError> {
        let not_object = || {
            BodyError::invalid(format!(
                "{at} must be a JSON object with a string `role`; got {}",
                canonical::kind(raw)
            ))
        };
        if canonical::kind(raw) != "an object" {
            return Err(not_object());
        }
        let entries = canonical::entries(raw.get()).map_err(|_| not_object())?;
        let role = entries.iter().rev().find(|(key, _)| key == "role");
        match role.map(|(_, value)| (canonical::kind(value), *value)) {
            Some(("a string", value)) => {
                if value.get() == "\"\"" {
                    return Err(BodyError::invalid(format!("{at}.role must not be empty")));
                }
            }
            Some((kind, _)) => {
                return Err(BodyError::invalid(format!(
                    "{at}.role must be a string; got {kind}"
                )));
            }
            None => {
                return Err(BodyError::invalid(format!(
                    "{at} has no `role`; every message needs a non-empty string role"
                )));
            }
        }
        drop(entries);
        let mut body = String::with_capacity(raw.get().len());
        canonical::write(raw, JsonPath::Root(at), &mut body)?;
        let digest = digest16(&body);
        Ok(Self { body, digest })
    }

    /// [`NewMessage::from_raw`] for a value at hand (tests, tools).
    pub fn from_value(value: serde_json::Value, at: &str) -> Result<Self, BodyError> {
        let text = value.to_string();
        let raw: &RawValue = serde_json::from_str(&text).map_err(|e| BodyError::malformed(&e))?;
        Self::from_raw(raw, at)
    }

    pub fn body(&self) -> &str {
        &self.body
    }

    pub fn digest(&self) -> [u8; 16] {
        self.digest
    }
}

/// Why a request body was refused: malformed JSON (400), valid JSON that
/// breaks a rule (422), or more messages than the operation takes (its
/// handler words that, naming its own limit).
#[derive(Debug)]
pub enum BodyError {
    Malformed(String),
    Invalid(Invalid),
    TooMany(usize),
}

impl BodyError {
    fn invalid(detail: String) -> Self {
        Self::Invalid(Invalid(detail))
    }

    fn malformed(e: &serde_json::Error) -> Self {
        let hint = if e.to_string().contains("escape") {
            " (a \\uD800-\\uDFFF escape must be one half of a surrogate pair)"
        } else {
            ""
        };
        Self::Malformed(format!("the body is not valid JSON: {e}{hint}"))
    }
}

impl From<CanonicalError> for BodyError {
    fn from(e: CanonicalError) -> Self {
        match e {
            CanonicalError::Malformed(e) => Self::malformed(&e),
            CanonicalError::Nul(path) => Self::invalid(format!(
                "{path} contains a NUL character (\\u0000), which the store cannot keep faithfully; remove or replace it"
            )),
        }
    }
}

/// The body of an append or a transcript save, `{"messages": [...]}`, each
/// message checked and made canonical, and the digest of the whole body as
/// canonical JSON (what an `Idempotency-Key` is checked against).
#[derive(Debug)]
pub struct MessageBody {
    pub messages: Vec<NewMessage>,
    pub digest: [u8; 16],
}

impl MessageBody {
    /// Parses `bytes` without building a tree of them; more than `max`
    /// messages is `TooMany`, found before any message is copied.
    pub fn parse(bytes: &[u8], max: usize) -> Result<Self, BodyError> {
        let text = std::str::from_utf8(bytes)
            .map_err(|e| BodyError::Malformed(format!("the body is not valid JSON: {e}")))?;
        let top: &RawValue = serde_json::from_str(text).map_err(|e| BodyError::malformed(&e))?;
        if canonical::kind(top) != "an object" {
            return Err(BodyError::invalid(format!(
                "the body must be a JSON object like {{\"messages\": [...]}}; got {}",
                canonical::kind(top)
            )));
        }
        let mut members = canonical::entries(top.get()).map_err(|e| BodyError::malformed(&e))?;
        // Stable: of repeated keys the last one counts, as in serde_json.
        members.sort_by(|a, b| a.0.cmp(&b.0));
        let Some(list) = members
            .iter()
            .rev()
            .find(|(key, _)| key == "messages")
            .map(|m| m.1)
        else {
            return Err(BodyError::invalid(
                "the body has no `messages` field; send {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}]}"
                    .into(),
            ));
        };
        if canonical::kind(list) != "a list" {
            return Err(BodyError::invalid(format!(
                "`messages` must be a list of message objects; got {}",
                canonical::kind(list)
            )));
        }
        let count = canonical::count_elements(list.get()).map_err(|e| BodyError::malformed(&e))?;
        if count > max {
            return Err(BodyError::TooMany(count));
        }
        let mut messages = Vec::with_capacity(count);
        let mut failure = None;
        canonical::for_each_element(list.get(), |i, raw| {
            match NewMessage::from_raw(raw, &format!("messages[{i}]")) {
                Ok(message) => messages.push(message),
                Err(e) => failure = Some(e),
            }
            failure.is_none()
        })
        .map_err(|e| BodyError::malformed(&e))?;
        if let Some(e) = failure {
            return Err(e);
        }
        let digest = body_digest(&members, &messages)?;
        Ok(Self { messages, digest })
    }
}

/// The digest of the body as canonical JSON, `{"k":v,…}` with keys in
/// order, fed to the hash piece by piece rather than written out whole.
fn body_digest(
    members: &[(String, &RawValue)],
    messages: &[NewMessage],
) -> Result<[u8; 16], BodyError> {
    let mut hasher = Sha256::new();
    hasher.update(b"{");
    let mut first = true;
    for (i, (key, value)) in members.iter().enumerate() {
        if members.get(i + 1).is_some_and(|next| next.0 == *key) {
            continue;
        }
        if !first {
            hasher.update(b",");
        }
        first = false;
        hasher.update(serde_json::to_string(key).unwrap_or_default().as_bytes());
        hasher.update(b":");
        if key == "messages" {
            hasher.update(b"[");
            for (j, message) in messages.iter().enumerate() {
                if j > 0 {
                    hasher.update(b",");
                }
                hasher.update(message.body().as_bytes());
            }
            hasher.update(b"]");
        } else {
            let mut text = String::new();
            canonical::write(value, JsonPath::Root(key), &mut text)?;
            hasher.update(text.as_bytes());
        }
    }
    hasher.update(b"}");
    let mut digest = [0u8; 16];
    digest.copy_from_slice(&hasher.finalize()[..16]);
    Ok(digest)
}

/// A message as the store keeps it: the caller's message, verbatim, with what
/// the server adds beside it. The body is shared: a page kept for later
/// reads hands out the same one, checked once, to each of them.
#[derive(Debug, Clone, Serialize)]
pub struct StoredMessage {
    pub seq: i64,
    pub created_at: Timestamp,
    pub message: Arc<RawValue>,
}

impl StoredMessage {
    /// `body` is text a store wrote from a `NewMessage`, so it is valid JSON.
    pub fn new(seq: i64, created_at: Timestamp, body: String) -> Result<Self, serde_json::Error> {
        Ok(Self {
            seq,
            created_at,
            message: RawValue::from_string(body)?.into(),
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
    /// `request_digest` is the digest of the whole request body as canonical
    /// JSON ([`MessageBody::digest`]): equal JSON values give equal digests.
    pub fn new(key: &str, request_digest: [u8; 16]) -> Result<Self, Invalid> {
        Self::check_key(key)?;
        Ok(Self {
            key: key.to_string(),
            request_digest,
        })
    }

    /// Whether `key` is a usable key: 1 to 255 characters.
    pub fn check_key(key: &str) -> Result<(), Invalid> {
        if key.is_empty() {
            return Err(Invalid("Idempotency-Key must not be empty".into()));
        }
        let chars = key.chars().count();
        if chars > IDEMPOTENCY_KEY_MAX_CHARS {
            return Err(Invalid(format!(
                "Idempotency-Key is {chars} characters long; the limit is {IDEMPOTENCY_KEY_MAX_CHARS}"
            )));
        }
        Ok(())
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
    /// The save would delete more stored messages than one save may (at
    /// least this many); nothing changed.
    WouldRemove {
        at_least: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_print_as_chrono_prints_them() {
        let chrono = |t: Timestamp| t.to_datetime().to_rfc3339_opts(SecondsFormat::Micros, true);
        // Leap days, month and year ends, the epoch, the last year written
        // by hand, and a spread of instants between.
        let mut instants = vec![
            0,
            951_782_400_000_000 - 1,
            951_782_400_000_000,
            4_107_542_399_999_999,
            253_402_300_799_999_999,
            253_402_300_800_000_000,
            -1,
        ];
        let mut x: i64 = 0x2545_f491_4f6c_dd1d;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            instants.push(x.rem_euclid(253_402_300_800_000_000));
        }
        for micros in instants {
            let t = Timestamp::from_micros(micros);
            assert_eq!(t.to_string(), chrono(t), "{micros}");
            assert_eq!(
                serde_json::to_string(&t).unwrap(),
                format!("\"{}\"", chrono(t)),
                "{micros}"
            );
        }
    }

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

    fn message(text: &str, at: &str) -> Result<NewMessage, BodyError> {
        NewMessage::from_raw(serde_json::from_str(text).unwrap(), at)
    }

    fn detail(error: BodyError) -> String {
        match error {
            BodyError::Invalid(invalid) => invalid.0,
            other => panic!("expected a 422, got {other:?}"),
        }
    }

    #[test]
    fn messages_need_an_object_with_a_role() {
        assert!(message(r#"{"role": "user"}"#, "m").is_ok());
        for bad in [
            r#"{"content": "hi"}"#,
            r#"{"role": ""}"#,
            r#"{"role": 3}"#,
            r#""text""#,
            "null",
        ] {
            assert!(
                matches!(message(bad, "m"), Err(BodyError::Invalid(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn nul_is_found_in_values_and_keys() {
        let err = detail(
            message(
                r#"{"role": "user", "parts": [{"text": "a\u0000b"}]}"#,
                "messages[2]",
            )
            .unwrap_err(),
        );
        assert!(
            err.starts_with("messages[2].parts[0].text contains a NUL"),
            "{err}"
        );
        let err = detail(message(r#"{"role": "user", "k\u0000": 1}"#, "m").unwrap_err());
        assert!(err.contains("a key in m"), "{err}");
    }

    #[test]
    fn big_numbers_keep_every_digit() {
        let message =
            message(r#"{"role":"user","n":123456789012345678901234567890}"#, "m").unwrap();
        assert!(message.body().contains("123456789012345678901234567890"));
    }

    #[test]
    fn bodies_are_checked_in_order_of_cost() {
        let parse = |text: &str| MessageBody::parse(text.as_bytes(), 2);
        assert!(matches!(parse("{"), Err(BodyError::Malformed(_))));
        assert!(matches!(parse("[]"), Err(BodyError::Invalid(_))));
        assert!(matches!(parse("{}"), Err(BodyError::Invalid(_))));
        assert!(matches!(
            parse(r#"{"messages": {}}"#),
            Err(BodyError::Invalid(_))
        ));
        assert!(matches!(
            parse(r#"{"messages": [1, 2, 3]}"#),
            Err(BodyError::TooMany(3))
        ));
        assert!(matches!(
            parse(r#"{"messages": [{"role": "user", "c": "\ud800"}]}"#),
            Err(BodyError::Malformed(_))
        ));
        let body = parse(r#"{"messages": [{"role": "user"}, {"role": "tool"}]}"#).unwrap();
        assert_eq!(body.messages.len(), 2);
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
        let digest = |text: &str| MessageBody::parse(text.as_bytes(), 10).unwrap().digest;
        let a = digest(r#"{"messages":[{"role":"user","a":1,"b":2}]}"#);
        let b = digest(r#"{ "messages": [ {"b":2, "role":"user", "a":1} ] }"#);
        let c = digest(r#"{"messages":[{"role":"user","a":1,"b":3}]}"#);
        assert_eq!(a, b);
        assert_ne!(a, c);
        // The digest of the canonical text of the whole body, as before.
        for text in [
            r#"{"messages":[{"role":"user","a":1,"b":2}]}"#,
            r#"{"z": [1.50, {"y": null}], "messages": [{"role": "user"}], "a": "x", "a": "y"}"#,
        ] {
            let value: serde_json::Value = serde_json::from_str(text).unwrap();
            assert_eq!(
                digest(text),
                digest16(&serde_json::to_string(&value).unwrap()),
                "{text}"
            );
        }
        assert!(Idempotency::new(&"k".repeat(255), a).is_ok());
        assert!(Idempotency::new(&"k".repeat(256), a).is_err());
        assert!(Idempotency::new("", a).is_err());
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
