//! The storage seam: one `Store` trait, one implementation per backend, and
//! `connect` which picks the backend once from the `DATABASE_URL` scheme.
//!
//! Invariants every implementation keeps, whatever the backend:
//! - a user's row in `chat_users` is locked (or, on SQLite, the single writer
//!   held) before any of that user's messages are touched, so `seq` is
//!   allocated in commit order and counters never drift;
//! - the `chat_users` row outlives a clear, so `seq` and `version` never repeat;
//! - within one user `created_at` never decreases as `seq` grows, which lets
//!   every read walk the primary key and stay O(rows returned).

mod postgres;
mod sqlite;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::domain::{
    AppendOutcome, Appended, HistoryPage, HistoryQuery, Idempotency, IfMatch, NewMessage,
    SaveOutcome, StoredMessage, Tenant, Timestamp, Transcript, UserId, UserStats, UserSummary,
};

pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or is shedding load; retrying later may work.
    #[error("the database is unavailable")]
    Unavailable(#[source] sqlx::Error),
    #[error("database error")]
    Database(#[source] sqlx::Error),
    #[error("migrations failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("the schema is not up to date: applied {applied:?}, this build needs {expected}")]
    NotMigrated { applied: Option<i64>, expected: i64 },
    #[error("unsupported DATABASE_URL {0:?}: use sqlite://PATH or postgres://USER@HOST/DB")]
    UnsupportedUrl(String),
    #[error("stored data could not be read back: {0}")]
    Corrupt(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        if is_unavailable(&error) {
            Self::Unavailable(error)
        } else {
            Self::Database(error)
        }
    }
}

/// Errors after which the same request may succeed later: the connection is
/// gone, the pool is exhausted, the server is starting or shutting down, or
/// SQLite's single writer stayed busy past the timeout.
fn is_unavailable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            // Postgres: connection exceptions (08…), admin shutdown / cannot
            // connect now (57P0…), too many connections (53300). SQLite: BUSY, LOCKED.
            code.starts_with("08")
                || code.starts_with("57P0")
                || code == "53300"
                || code == "5"
                || code == "6"
        }
        _ => false,
    }
}

/// How a store connects; the rest of its behaviour comes from each call.
#[derive(Debug, Clone, Copy)]
pub struct ConnectOptions {
    pub max_connections: u32,
    pub acquire_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
        }
    }
}

/// The only seam between the service and its database.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Applies the backend's pending migrations.
    async fn migrate(&self) -> Result<(), StoreError>;

    /// Ok when the database answers and every migration of this build is applied.
    async fn ready(&self) -> Result<(), StoreError>;

    /// Appends `messages` atomically and in order; with `cap`, evicts the
    /// user's oldest messages in the same transaction so at most `cap` remain.
    /// With `idempotency`, a key already seen replays the first append (equal
    /// body) or is refused (another body), and nothing is stored.
    async fn append_messages(
        &self,
        tenant: &Tenant,
        user: &UserId,
        messages: &[NewMessage],
        now: Timestamp,
        cap: Option<u64>,
        idempotency: Option<&Idempotency>,
    ) -> Result<AppendOutcome, StoreError>;

    /// The whole transcript; empty, with the user's version, for a user whose
    /// messages are all gone; `None` for a user never written (version 0).
    async fn transcript(
        &self,
        tenant: &Tenant,
        user: &UserId,
    ) -> Result<Option<Transcript>, StoreError>;

    /// Replaces the transcript atomically, keeping the longest common prefix
    /// untouched (same `seq`, same `created_at`, rows not rewritten).
    async fn save_transcript(
        &self,
        tenant: &Tenant,
        user: &UserId,
        messages: &[NewMessage],
        if_match: Option<&IfMatch>,
        now: Timestamp,
        cap: Option<u64>,
    ) -> Result<SaveOutcome, StoreError>;

    /// Deletes the tenant's messages created before `cutoff`, in short
    /// transactions of bounded size, and says how many.
    async fn purge_expired(&self, tenant: &Tenant, cutoff: Timestamp) -> Result<u64, StoreError>;

    /// Deletes every message of the tenant, user by user in short
    /// transactions, and says how many.
    async fn clear_all(&self, tenant: &Tenant) -> Result<u64, StoreError>;

    /// One run of the retention task over every tenant: messages created
    /// before `cutoff` (when retention is on) and idempotency keys stored
    /// before `keys_cutoff`. `None` when another replica is running it.
    async fn retention_pass(
        &self,
        cutoff: Option<Timestamp>,
        keys_cutoff: Timestamp,
    ) -> Result<Option<RetentionReport>, StoreError>;

    /// A page of one user's history, oldest first (see `HistoryQuery`).
    async fn history_window(
        &self,
        tenant: &Tenant,
        user: &UserId,
        query: HistoryQuery,
    ) -> Result<HistoryPage, StoreError>;

    async fn message(
        &self,
        tenant: &Tenant,
        user: &UserId,
        seq: i64,
    ) -> Result<Option<StoredMessage>, StoreError>;

    /// Deletes one message; false when there was none with that `seq`.
    async fn delete_message(
        &self,
        tenant: &Tenant,
        user: &UserId,
        seq: i64,
    ) -> Result<bool, StoreError>;

    /// `None` when the user has no messages.
    async fn user_stats(
        &self,
        tenant: &Tenant,
        user: &UserId,
    ) -> Result<Option<UserStats>, StoreError>;

    /// Deletes every message of the user and says how many there were.
    async fn clear_user(&self, tenant: &Tenant, user: &UserId) -> Result<u64, StoreError>;

    /// Users with messages, ordered by the bytes of `user_id`, after `after`;
    /// the flag says whether more follow.
    async fn list_users(
        &self,
        tenant: &Tenant,
        after: Option<&UserId>,
        limit: u32,
    ) -> Result<(Vec<UserSummary>, bool), StoreError>;

    /// Connections of the pools, in use and idle, for `/metrics`.
    fn pool_status(&self) -> PoolStatus;

    /// Closes the pools, waiting for connections in use to come back.
    async fn close(&self);
}

/// Database pool connections, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStatus {
    pub in_use: u64,
    pub idle: u64,
}

impl PoolStatus {
    fn of<DB: sqlx::Database>(pool: &sqlx::Pool<DB>) -> Self {
        let size = u64::from(pool.size());
        let idle = pool.num_idle() as u64;
        Self {
            in_use: size.saturating_sub(idle),
            idle,
        }
    }
}

/// What one retention run deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetentionReport {
    pub messages: u64,
    pub idempotency_keys: u64,
}

/// Users locked and purged per retention transaction.
const PURGE_USERS_PER_BATCH: i64 = 100;
/// Users cleared per `clear_all` transaction.
const CLEAR_USERS_PER_BATCH: i64 = 100;
/// Idempotency keys deleted per transaction.
const KEYS_PER_BATCH: i64 = 1000;

/// Every tenant that has a user row, by a loose index scan of the primary
/// key of `chat_users` (one probe per tenant); the same SQL on both backends.
const TENANTS: &str = r#"
WITH RECURSIVE t(tenant) AS (
    SELECT min(tenant) FROM chat_users
    UNION ALL
    SELECT (SELECT min(tenant) FROM chat_users WHERE tenant > t.tenant)
    FROM t WHERE t.tenant IS NOT NULL
)
SELECT tenant FROM t WHERE tenant IS NOT NULL
"#;

/// The messages of an append as stored: consecutive `seq` from `first_seq`,
/// one `created_at`, bodies as given.
fn appended(
    messages: &[NewMessage],
    first_seq: i64,
    created_at: Timestamp,
    version: i64,
) -> Result<Appended, StoreError> {
    let messages = messages
        .iter()
        .zip(first_seq..)
        .map(|(m, seq)| {
            StoredMessage::new(seq, created_at, m.body().to_owned())
                .map_err(|e| StoreError::Corrupt(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    Ok(Appended { messages, version })
}

/// A page of the user listing from up to `limit + 1` rows of
/// (user_id, message_count, newest_at), and whether more follow.
fn users_page(
    rows: Vec<(String, i64, Timestamp)>,
    limit: u32,
) -> Result<(Vec<UserSummary>, bool), StoreError> {
    let has_more = rows.len() > limit as usize;
    let users = rows
        .into_iter()
        .take(limit as usize)
        .map(|(user_id, message_count, newest_at)| {
            Ok(UserSummary {
                user_id: UserId::parse(user_id).map_err(|e| StoreError::Corrupt(e.0))?,
                message_count,
                newest_at,
            })
        })
        .collect::<Result<_, StoreError>>()?;
    Ok((users, has_more))
}

/// A transcript from its rows of (version, message) in `seq` order, as the
/// user row left-joined to its messages gives them: none without rows (a
/// user never written), and one row with no message for a user with none.
fn transcript_from(rows: Vec<(i64, Option<String>)>) -> Result<Option<Transcript>, StoreError> {
    let Some(version) = rows.first().map(|(version, _)| *version) else {
        return Ok(None);
    };
    let messages = rows
        .into_iter()
        .filter_map(|(_, body)| body)
        .map(raw)
        .collect::<Result<_, _>>()?;
    Ok(Some(Transcript { messages, version }))
}

/// An idempotency record found for an append's key.
struct SeenKey {
    request_digest: Vec<u8>,
    first_seq: i64,
    created_at: Timestamp,
    version: i64,
}

impl SeenKey {
    /// The answer to a repeated key: what the first append stored when the
    /// bodies are equal, a refusal when they are not.
    fn outcome(
        self,
        key: &Idempotency,
        messages: &[NewMessage],
    ) -> Result<AppendOutcome, StoreError> {
        if digest(&self.request_digest)? != key.request_digest() {
            return Ok(AppendOutcome::KeyReused);
        }
        appended(messages, self.first_seq, self.created_at, self.version)
            .map(AppendOutcome::Replayed)
    }
}

/// A stored body as a raw JSON value.
fn raw(body: String) -> Result<Box<serde_json::value::RawValue>, StoreError> {
    serde_json::value::RawValue::from_string(body).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// A stored digest as 16 bytes.
fn digest(bytes: &[u8]) -> Result<[u8; 16], StoreError> {
    bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("a digest of {} bytes", bytes.len())))
}

/// The `Saved` answer once the common prefix `kept` of `stored` messages
/// and `incoming` messages is known, before eviction.
fn saved(version: i64, stored: usize, incoming: usize, kept: usize, evicted: u64) -> SaveOutcome {
    SaveOutcome::Saved(crate::domain::Saved {
        version,
        kept: (kept as u64).saturating_sub(evicted),
        appended: (incoming - kept) as u64,
        removed: (stored - kept) as u64 + evicted,
    })
}

/// Picks the backend from the URL scheme and opens its pools (lazily for
/// Postgres, so a service can start before its database).
pub async fn connect(url: &str, options: ConnectOptions) -> Result<Arc<dyn Store>, StoreError> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(Arc::new(PostgresStore::connect(url, options)?))
    } else if url.starts_with("sqlite:") {
        Ok(Arc::new(SqliteStore::connect(url, options).await?))
    } else {
        Err(StoreError::UnsupportedUrl(redact_url(url)))
    }
}

/// A URL with any password replaced, safe to log or print.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((credentials, host)) => {
            let user = credentials.split(':').next().unwrap_or_default();
            if credentials.contains(':') {
                format!("{scheme}://{user}:***@{host}{path}")
            } else {
                url.to_string()
            }
        }
        None => url.to_string(),
    }
}

/// The newest migration version a migrator carries.
fn latest_version(migrator: &sqlx::migrate::Migrator) -> i64 {
    migrator.iter().map(|m| m.version).max().unwrap_or(0)
}

/// Turns the stored rows of a page into messages, oldest first, applying the
/// age cut-off and working out `has_more`. `rows` come in the page's
/// direction (newest first when paging back) and hold up to `limit + 1` rows.
fn assemble_page(
    rows: Vec<(i64, Timestamp, String)>,
    query: HistoryQuery,
) -> Result<HistoryPage, StoreError> {
    let limit = query.limit as usize;
    let paging_forward = query.after.is_some();
    let passes = |at: Timestamp| query.not_before.is_none_or(|cut| at >= cut);
    // Paging back, rows are newest first and `created_at` never increases
    // along them, so those that pass the age filter are a prefix.
    let mut kept: Vec<(i64, Timestamp, String)> = if paging_forward {
        rows
    } else {
        rows.into_iter()
            .take_while(|(_, at, _)| passes(*at))
            .collect()
    };
    let has_more = kept.len() > limit;
    kept.truncate(limit);
    if !paging_forward {
        kept.reverse();
    }
    let messages = kept
        .into_iter()
        .map(|(seq, at, body)| {
            StoredMessage::new(seq, at, body).map_err(|e| StoreError::Corrupt(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    Ok(HistoryPage { messages, has_more })
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn passwords_never_leave_redact_url() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/chat"),
            "postgres://app:***@db:5432/chat"
        );
        assert_eq!(
            redact_url("postgres://app@db/chat"),
            "postgres://app@db/chat"
        );
        assert_eq!(redact_url("sqlite://chat.db"), "sqlite://chat.db");
    }
}
