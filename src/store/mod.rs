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

mod batch;
mod fold;
mod postgres;
mod readers;
mod recent;
mod sql;
mod sqlite;
mod url;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::domain::{
    AppendOutcome, Appended, HistoryPage, HistoryQuery, Idempotency, IfMatch, NewMessage,
    SaveOutcome, StoredMessage, Tenant, Timestamp, Transcript, UserId, UserStats, UserSummary,
};

pub use postgres::PostgresStore;
pub use sql::SqlStore;
pub use sqlite::SqliteStore;
pub use url::{
    certificate_file, unused_client_certificate, DatabaseUrl, PoolMode,
    CLIENT_CERTIFICATE_VARIABLES,
};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or is shedding load; retrying later may work.
    #[error("the database is unavailable")]
    Unavailable(#[source] sqlx::Error),
    #[error("database error")]
    Database(#[source] sqlx::Error),
    #[error("migrations failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    #[error("the schema is not up to date: applied {applied:?}, this build needs {expected}")]
    NotMigrated { applied: Option<i64>, expected: i64 },
    #[error("unsupported DATABASE_URL {0:?}: use sqlite://PATH or postgres://USER@HOST/DB")]
    UnsupportedUrl(String),
    /// A `DATABASE_URL` that names its backend but says something it cannot mean.
    #[error("{0}")]
    BadUrl(String),
    #[error("stored data could not be read back: {0}")]
    Corrupt(String),
    #[error("the transcript was not read within the request timeout")]
    TimedOut,
    /// Shedding load rather than queueing it; the text says which limit.
    #[error("{0}")]
    Busy(&'static str),
    /// What a [`UserRows`] source could not give (a bad line of an import,
    /// say); the load it fed changed nothing.
    #[error("{0}")]
    Input(String),
    /// A retention run lost its lease to another replica after deleting
    /// this many messages; never seen outside the store.
    #[error("the retention lease was lost")]
    LeaseLost(u64),
    /// The database went away during a commit this append shared with
    /// others: every append of it gets this.
    #[error("the commit this append shared failed")]
    Shared(#[source] Arc<StoreError>),
}

impl StoreError {
    /// The database could not be reached or is shedding load: a retry
    /// later may work, whatever the request.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::Busy(_) | Self::Shared(_))
    }
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(error: sqlx::migrate::MigrateError) -> Self {
        match error {
            // Not a migration that failed: the database could not be reached
            // (refused, TLS, authentication), and the error should say so.
            sqlx::migrate::MigrateError::Execute(inner) if is_connection_error(&inner) => {
                Self::from(inner)
            }
            other => Self::Migrate(other),
        }
    }
}

/// Errors of reaching the database rather than of a statement: whatever
/// [`is_unavailable`] says, and authorization refusals (SQLSTATE class 28,
/// where pg_hba.conf rejections land).
fn is_connection_error(error: &sqlx::Error) -> bool {
    is_unavailable(error)
        || matches!(error, sqlx::Error::Database(db)
            if db.code().is_some_and(|code| code.starts_with("28")))
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

/// A count as the databases keep it. Counts here are bounded far below
/// `i64::MAX`; were one not, it would saturate rather than wrap.
fn db_count<T: TryInto<i64>>(n: T) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// A count read back from the database, which never stores a negative one.
fn row_count(n: i64) -> usize {
    usize::try_from(n).unwrap_or(0)
}

/// How a store connects; the rest of its behaviour comes from each call.
#[derive(Debug, Clone, Copy)]
pub struct ConnectOptions {
    pub max_connections: u32,
    pub acquire_timeout: Duration,
    /// Appends written in one shared commit, at most (1: each alone).
    pub commit_batch: usize,
    /// What Postgres's recent pages may take, in bytes (0: none kept).
    pub read_cache_bytes: usize,
    /// What the bodies of one history page may take, in bytes: a page is
    /// cut short there (see [`Page`]).
    pub page_bytes: usize,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
            commit_batch: 256,
            read_cache_bytes: 64 << 20,
            page_bytes: 4 << 20,
        }
    }
}

/// A pooled connection idle for longer than this is checked (pinged)
/// before it is handed out: long enough idle that the server may have
/// dropped it (a restart, an idle timeout). A busy connection is not
/// checked, which would cost a round trip per statement.
pub(crate) const PING_WHEN_IDLE_FOR: Duration = Duration::from_secs(1);

/// Pool options both backends share: the size and wait from `options`, and
/// the check above in place of sqlx's ping before every acquire.
fn pool_options<DB: sqlx::Database>(
    max_connections: u32,
    options: &ConnectOptions,
) -> sqlx::pool::PoolOptions<DB> {
    use sqlx::Connection;
    sqlx::pool::PoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(options.acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn: &mut DB::Connection, meta| {
            Box::pin(async move {
                if meta.idle_for < PING_WHEN_IDLE_FOR {
                    return Ok(true);
                }
                // A broken connection is closed, and another one taken.
                Ok(conn.ping().await.is_ok())
            })
        })
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

    /// The whole transcript from one read snapshot: its version and message
    /// count, then its messages in order, sent by a task of the store's own
    /// as they are read, so a reader holds a few rows at a time whatever the
    /// transcript's size. Waiting for a stream slot (see `StreamSlots`) and
    /// reading the rows both fit in `deadline`: a read that cannot start in
    /// time is `Busy`, one that cannot finish ends with `TimedOut`. A user
    /// never written has version 0 and no messages.
    async fn transcript_stream(
        &self,
        tenant: &Tenant,
        user: &UserId,
        deadline: Duration,
    ) -> Result<TranscriptStream, StoreError>;

    /// The whole transcript in memory (for tests and tools; the API streams):
    /// `None` for a user never written.
    async fn transcript(
        &self,
        tenant: &Tenant,
        user: &UserId,
    ) -> Result<Option<Transcript>, StoreError> {
        let mut stream = self
            .transcript_stream(tenant, user, Duration::from_secs(3600))
            .await?;
        let mut messages = Vec::new();
        while let Some(row) = stream.messages.recv().await {
            messages.push(raw(row?)?);
        }
        Ok((stream.version > 0).then_some(Transcript {
            messages,
            version: stream.version,
        }))
    }

    /// Replaces the transcript atomically, keeping the longest common prefix
    /// untouched (same `seq`, same `created_at`, rows not rewritten). One
    /// save deletes at most `max_removed` stored messages, so that its one
    /// transaction stays short; past that it is `WouldRemove` and changes
    /// nothing.
    #[allow(clippy::too_many_arguments)]
    async fn save_transcript(
        &self,
        tenant: &Tenant,
        user: &UserId,
        messages: &[NewMessage],
        if_match: Option<&IfMatch>,
        now: Timestamp,
        cap: Option<u64>,
        max_removed: usize,
    ) -> Result<SaveOutcome, StoreError>;

    /// Deletes the tenant's messages older than `max_age` by the database's
    /// clock, in short transactions of bounded size, and says how many.
    async fn purge_expired(&self, tenant: &Tenant, max_age: Duration) -> Result<u64, StoreError>;

    /// Deletes every message of the tenant, user by user in short
    /// transactions, and says how many.
    async fn clear_all(&self, tenant: &Tenant) -> Result<u64, StoreError>;

    /// One run of the retention task over every tenant: messages older than
    /// `retention` (when it is on) and idempotency keys older than
    /// `keys_ttl`, both by the database's clock, so a replica whose clock
    /// jumps cannot delete what has not expired. `None` when another replica
    /// is running it.
    async fn retention_pass(
        &self,
        retention: Option<Duration>,
        keys_ttl: Duration,
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

    /// Users, with or without messages, in `(tenant, user_id)` order after
    /// `after`, of every tenant or only of `tenant`: for copying and export.
    async fn dump_users(
        &self,
        tenant: Option<&str>,
        after: Option<(&str, &str)>,
        limit: u32,
    ) -> Result<Vec<UserRecord>, StoreError>;

    async fn user_record(&self, tenant: &str, user: &str)
        -> Result<Option<UserRecord>, StoreError>;

    /// The user's messages after `after_seq`, in order, as stored.
    async fn dump_messages(
        &self,
        tenant: &str,
        user: &str,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<MessageRecord>, StoreError>;

    /// The user's idempotency keys after `after`, in key order, as stored.
    async fn dump_keys(
        &self,
        tenant: &str,
        user: &str,
        after: &str,
        limit: u32,
    ) -> Result<Vec<KeyRecord>, StoreError>;

    /// Writes users that are not in this store yet, exactly as `rows` gives
    /// them, in one transaction: all of them, or (on any error, `rows`' own
    /// included) none.
    async fn load_users(&self, rows: &mut dyn UserRows) -> Result<(), StoreError>;

    /// How many users and messages the store holds.
    async fn totals(&self) -> Result<(u64, u64), StoreError>;

    /// Connections of the pools, in use and idle, for `/metrics`.
    fn pool_status(&self) -> PoolStatus;

    /// Closes the pools, waiting for connections in use to come back.
    async fn close(&self);
}

/// A user's row as stored, so that a copy keeps it exactly.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct UserRecord {
    pub tenant: String,
    pub user_id: String,
    pub last_seq: i64,
    pub version: i64,
    pub message_count: i64,
    pub last_created_at: Timestamp,
    pub oldest_at: Option<Timestamp>,
    pub transcript_digest: Option<Vec<u8>>,
}

/// A message as stored: the body verbatim, its 16-byte digest.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct MessageRecord {
    pub seq: i64,
    pub created_at: Timestamp,
    pub message: String,
    pub digest: Vec<u8>,
}

/// An idempotency record as stored, with its age (`stored_at`).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct KeyRecord {
    pub key: String,
    pub request_digest: Vec<u8>,
    pub first_seq: i64,
    pub created_at: Timestamp,
    pub version: i64,
    pub stored_at: Timestamp,
}

/// Where [`Store::load_users`] takes users from, a batch at a time, so
/// that a user of any size costs bounded memory: for each user, its
/// messages in `seq` order, then its keys, then its row.
#[async_trait]
pub trait UserRows: Send {
    /// Moves on to the next user of this transaction: `(tenant, user_id)`,
    /// or `None` when the transaction should end here.
    async fn next_user(&mut self) -> Result<Option<(String, String)>, StoreError>;
    /// The user's next messages; none when there are no more.
    async fn messages(&mut self) -> Result<Vec<MessageRecord>, StoreError>;
    /// The user's next idempotency keys; none when there are no more.
    async fn keys(&mut self) -> Result<Vec<KeyRecord>, StoreError>;
    /// The user's row, asked for last.
    async fn user(&mut self) -> Result<UserRecord, StoreError>;
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

/// A transcript as [`Store::transcript_stream`] reads it.
pub struct TranscriptStream {
    pub version: i64,
    pub message_count: i64,
    /// The messages' JSON text, in order; closed after the last.
    pub messages: mpsc::Receiver<Result<String, StoreError>>,
}

/// Transcript reads streaming at once, at most: half the pool (at least
/// one), so that slow readers, each holding a connection while they read,
/// can never hold every connection. A read over that waits for a slot
/// within its deadline (readers queue no longer than a request may last,
/// and no more of them than requests may be in flight), then gets 503.
#[derive(Clone)]
pub(crate) struct StreamSlots(Arc<Semaphore>);

impl StreamSlots {
    pub(crate) fn new(max_connections: u32) -> Self {
        let max_connections = usize::try_from(max_connections).unwrap_or(usize::MAX);
        Self(Arc::new(Semaphore::new((max_connections / 2).max(1))))
    }

    pub(crate) async fn take(&self, until: Instant) -> Result<OwnedSemaphorePermit, StoreError> {
        match tokio::time::timeout_at(until, self.0.clone().acquire_owned()).await {
            Ok(Ok(slot)) => Ok(slot),
            _ => Err(StoreError::Busy(
                "as many transcripts are being read as this server streams at once (half of \
                 CHAT_HISTORY_DB_MAX_CONNECTIONS), and none finished in time; retry after the \
                 delay in Retry-After",
            )),
        }
    }
}

/// Rows of a transcript read ahead of a slow reader, at most.
const TRANSCRIPT_ROWS_AHEAD: usize = 8;

impl TranscriptStream {
    /// A stream whose rows a task sends (see [`forward_rows`]).
    fn new(version: i64, message_count: i64) -> (Self, mpsc::Sender<Result<String, StoreError>>) {
        let (sender, messages) = mpsc::channel(TRANSCRIPT_ROWS_AHEAD);
        let stream = Self {
            version,
            message_count,
            messages,
        };
        (stream, sender)
    }
}

/// Sends `rows` on to the reader until they end, the reader goes away, or
/// `until` passes (then the reader gets `TimedOut` as its last row).
async fn forward_rows(
    rows: impl futures_util::Stream<Item = Result<String, sqlx::Error>>,
    sender: mpsc::Sender<Result<String, StoreError>>,
    until: Instant,
) {
    use futures_util::StreamExt;
    let forward = async {
        futures_util::pin_mut!(rows);
        while let Some(row) = rows.next().await {
            let failed = row.is_err();
            if sender.send(row.map_err(StoreError::from)).await.is_err() || failed {
                return;
            }
        }
    };
    if tokio::time::timeout_at(until, forward).await.is_err() {
        let _ = sender.try_send(Err(StoreError::TimedOut));
    }
}

/// An idempotency record found for an append's key.
#[derive(sqlx::FromRow)]
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

/// `WouldRemove` when keeping `kept` of `stored` messages deletes more than
/// `max_removed`.
fn removes_too_many(stored: usize, kept: usize, max_removed: usize) -> Option<SaveOutcome> {
    let removed = stored.saturating_sub(kept);
    (removed > max_removed).then(|| SaveOutcome::WouldRemove {
        at_least: u64::try_from(removed).unwrap_or(u64::MAX),
    })
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
pub async fn connect(
    url: &DatabaseUrl,
    options: ConnectOptions,
) -> Result<Arc<dyn Store>, StoreError> {
    if url.is_postgres() {
        Ok(Arc::new(postgres::connect(url, options)?))
    } else if url.is_sqlite() {
        Ok(Arc::new(sqlite::connect(url.expose(), options).await?))
    } else {
        Err(StoreError::UnsupportedUrl(url.redacted()))
    }
}

/// The newest migration version a migrator carries.
fn latest_version(migrator: &sqlx::migrate::Migrator) -> i64 {
    migrator.iter().map(|m| m.version).max().unwrap_or(0)
}

/// A message as a page read returns it: `seq`, `created_at`, body (checked
/// as JSON once, when it was read from the database; see [`body`]).
pub type PageRow = (i64, Timestamp, Body);

/// A stored body, shared between a kept page and the reads it answers.
pub type Body = std::sync::Arc<serde_json::value::RawValue>;

/// A message as the database returns it, before its body is checked.
pub type StoredRow = (i64, Timestamp, String);

/// A body read from the database, checked as JSON.
fn body(text: String) -> Result<Body, StoreError> {
    raw(text).map(Body::from)
}

/// `row` with its body checked.
fn page_row((seq, at, text): StoredRow) -> Result<PageRow, StoreError> {
    Ok((seq, at, body(text)?))
}

/// What a page read found: its rows in the read's direction (newest first
/// paging back), and, when the read stopped short of its `limit` because
/// the bodies filled the page's byte budget, the `created_at` of the first
/// row it left out. Rows that could not be read with the others of a
/// batch (see `pages_back_many`) come back as no rows and a cut: the read
/// is then made alone.
#[derive(Debug, Default, Clone)]
pub struct Page {
    pub rows: Vec<PageRow>,
    pub cut: Option<Timestamp>,
}

impl Page {
    /// A batched read that must be made again alone.
    fn unread(&self) -> bool {
        self.rows.is_empty() && self.cut.is_some()
    }
}

/// Builds a [`Page`] from rows offered in the read's direction, keeping
/// them while their bodies fit `budget` bytes; the first row is always
/// kept, so a page never comes back empty while messages remain.
struct PageCut {
    budget: usize,
    bytes: usize,
    page: Page,
}

impl PageCut {
    fn new(budget: usize) -> Self {
        Self {
            budget,
            bytes: 0,
            page: Page::default(),
        }
    }

    /// Whether a row of `len` bytes still fits the page.
    fn fits(&self, len: usize) -> bool {
        self.page.rows.is_empty() || self.bytes.saturating_add(len) <= self.budget
    }

    /// Keeps `row`, or cuts the page before it; false once the page is cut,
    /// when the rows that follow need not be read.
    fn offer(&mut self, row: PageRow) -> bool {
        if self.page.cut.is_some() {
            return false;
        }
        let len = row.2.get().len();
        if !self.fits(len) {
            self.page.cut = Some(row.1);
            return false;
        }
        self.bytes += len;
        self.page.rows.push(row);
        true
    }

    /// `rows`, cut as `offer` would.
    fn all(budget: usize, rows: impl IntoIterator<Item = PageRow>) -> Page {
        let mut cut = Self::new(budget);
        for row in rows {
            if !cut.offer(row) {
                break;
            }
        }
        cut.page
    }
}

/// Turns the stored rows of a page into messages, oldest first, applying the
/// age cut-off and working out `has_more`. `rows` come in the page's
/// direction (newest first when paging back) and hold up to `limit + 1` rows.
/// A page cut for its bytes has more when the row it left out passes the
/// age filter.
fn assemble_page(page: Page, query: HistoryQuery) -> HistoryPage {
    let limit = query.limit as usize;
    let paging_forward = query.after.is_some();
    let passes = |at: Timestamp| query.not_before.is_none_or(|cut| at >= cut);
    let Page { rows, cut } = page;
    // Paging back, rows are newest first and `created_at` never increases
    // along them, so those that pass the age filter are a prefix (and when
    // the row a cut left out passes, so do all of them).
    let mut kept: Vec<PageRow> = if paging_forward {
        rows
    } else {
        rows.into_iter()
            .take_while(|(_, at, _)| passes(*at))
            .collect()
    };
    let cut_has_more = cut.is_some_and(|at| paging_forward || passes(at));
    let has_more = kept.len() > limit || cut_has_more;
    kept.truncate(limit);
    if !paging_forward {
        kept.reverse();
    }
    let messages = kept
        .into_iter()
        .map(|(seq, created_at, message)| StoredMessage {
            seq,
            created_at,
            message,
        })
        .collect();
    HistoryPage { messages, has_more }
}
