//! The embedded default. SQLite has one writer at a time, so writes go
//! through a pool of exactly one connection (no lock upgrades, no
//! `SQLITE_BUSY` between our own writers) while reads use a pool of
//! read-only connections that WAL lets run beside it. `synchronous = FULL`:
//! an acknowledged append survives a power cut, not only a crash.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::Row;

use std::collections::BTreeMap;

use sqlx::{Sqlite, Transaction};

use super::{
    appended, assemble_page, db_count, latest_version, removes_too_many, row_count, saved,
    stream_transcript, users_page, ConnectOptions, PoolStatus, RetentionReport, SeenKey, Store,
    StoreError, StreamSlots, TranscriptStream, CLEAR_USERS_PER_BATCH, KEYS_PER_BATCH,
    PURGE_USERS_PER_BATCH, TENANTS,
};
use crate::domain::{
    extends_saved, transcript_digest, AppendOutcome, HistoryPage, HistoryQuery, Idempotency,
    IfMatch, NewMessage, SaveOutcome, StoredMessage, Tenant, Timestamp, UserId, UserStats,
    UserSummary,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// Messages deleted per retention transaction, at most. Appends wait for the
/// single writer while a batch runs, so batches are kept short.
const PURGE_ROWS_PER_BATCH: i64 = 200;

/// Rows per INSERT statement: 3 bound values each, well under SQLite's
/// limit of 32,766 bound values per statement.
const INSERT_CHUNK: usize = 500;

/// Messages deleted per write transaction when a user is cleared.
const CLEAR_ROWS_PER_BATCH: i64 = 2000;

pub struct SqliteStore {
    writer: SqlitePool,
    reader: SqlitePool,
    streams: StreamSlots,
}

impl SqliteStore {
    pub async fn connect(url: &str, options: ConnectOptions) -> Result<Self, StoreError> {
        let connect = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(options.acquire_timeout)
            .foreign_keys(true);
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(options.acquire_timeout)
            .connect_with(connect.clone())
            .await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            .connect_lazy_with(connect.read_only(true));
        Ok(Self {
            writer,
            reader,
            streams: StreamSlots::new(options.max_connections),
        })
    }

    /// A write transaction that takes SQLite's write lock at once, so that a
    /// second process on the same file waits (`busy_timeout`) instead of
    /// failing when its read turns into a write.
    async fn write(&self) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
        self.writer.begin_with("BEGIN IMMEDIATE").await
    }

    /// SQLite's clock (in this process, but read through the database like
    /// every other backend's), for retention cutoffs.
    async fn database_now(&self) -> Result<Timestamp, StoreError> {
        let micros: i64 = sqlx::query_scalar(
            "SELECT CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)",
        )
        .fetch_one(&self.reader)
        .await?;
        Ok(Timestamp::from_micros(micros))
    }

    /// Deletes the tenant's messages created before `cutoff`, a bounded
    /// batch of users and rows per write transaction.
    async fn purge_before(&self, tenant: &Tenant, cutoff: Timestamp) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let mut tx = self.write().await?;
            let users: Vec<String> = sqlx::query_scalar(
                "SELECT user_id FROM chat_users WHERE tenant = ?1 AND oldest_at < ?2
                 ORDER BY oldest_at LIMIT ?3",
            )
            .bind(tenant.as_str())
            .bind(cutoff.as_micros())
            .bind(PURGE_USERS_PER_BATCH)
            .fetch_all(&mut *tx)
            .await?;
            if users.is_empty() {
                tx.commit().await?;
                return Ok(total);
            }
            let users = json_list(&users);
            let gone: Vec<String> = sqlx::query_scalar(DELETE_EXPIRED)
                .bind(tenant.as_str())
                .bind(&users)
                .bind(cutoff.as_micros())
                .bind(PURGE_ROWS_PER_BATCH)
                .fetch_all(&mut *tx)
                .await?;
            let mut per_user: BTreeMap<String, i64> = BTreeMap::new();
            for user in gone {
                *per_user.entry(user).or_default() += 1;
                total += 1;
            }
            for (user, deleted) in per_user {
                sqlx::query(
                    "UPDATE chat_users SET message_count = message_count - ?3, version = version + 1,
                     transcript_digest = NULL
                     WHERE tenant = ?1 AND user_id = ?2",
                )
                .bind(tenant.as_str())
                .bind(user)
                .bind(deleted)
                .execute(&mut *tx)
                .await?;
            }
            sqlx::query(REFRESH_OLDEST)
                .bind(tenant.as_str())
                .bind(&users)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        }
    }

    /// Deletes the user's messages up to its newest one now, a bounded batch
    /// per write transaction, so that clearing a long history never holds
    /// the only writer for long; appends arriving meanwhile are kept.
    async fn clear_user_on(&self, tenant: &Tenant, user: &str) -> Result<u64, StoreError> {
        let through: Option<i64> = sqlx::query_scalar(
            "SELECT last_seq FROM chat_users
             WHERE tenant = ?1 AND user_id = ?2 AND message_count > 0",
        )
        .bind(tenant.as_str())
        .bind(user)
        .fetch_optional(&self.reader)
        .await?;
        let Some(through) = through else {
            return Ok(0);
        };
        let mut total = 0;
        loop {
            let mut tx = self.write().await?;
            let deleted = sqlx::query(
                "DELETE FROM chat_messages WHERE rowid IN (
                    SELECT rowid FROM chat_messages
                    WHERE tenant = ?1 AND user_id = ?2 AND seq <= ?3
                    ORDER BY seq LIMIT ?4)",
            )
            .bind(tenant.as_str())
            .bind(user)
            .bind(through)
            .bind(CLEAR_ROWS_PER_BATCH)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if deleted == 0 {
                tx.rollback().await?;
                return Ok(total);
            }
            sqlx::query(
                "UPDATE chat_users SET version = version + 1, message_count = message_count - ?3,
                     transcript_digest = NULL,
                     oldest_at = (SELECT created_at FROM chat_messages m
                                  WHERE m.tenant = ?1 AND m.user_id = ?2 ORDER BY seq LIMIT 1)
                 WHERE tenant = ?1 AND user_id = ?2",
            )
            .bind(tenant.as_str())
            .bind(user)
            .bind(db_count(deleted))
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            total += deleted;
        }
    }
}

fn at(micros: i64) -> Timestamp {
    Timestamp::from_micros(micros)
}

const UPSERT_USER: &str = r#"
INSERT INTO chat_users
    (tenant, user_id, last_seq, version, message_count, last_created_at, oldest_at)
VALUES (?1, ?2, ?3, 1, ?3, ?4, ?4)
ON CONFLICT (tenant, user_id) DO UPDATE SET
    last_seq = last_seq + excluded.last_seq,
    version = version + 1,
    message_count = message_count + excluded.message_count,
    transcript_digest = NULL,
    last_created_at = max(last_created_at, excluded.last_created_at),
    oldest_at = CASE WHEN message_count = 0
        THEN max(last_created_at, excluded.last_created_at)
        ELSE oldest_at END
RETURNING last_seq, version, last_created_at, message_count
"#;

/// Creates the user's row if needed and reads its counters; the writer
/// connection is already exclusive, so this is what the Postgres lock is.
const LOCK_USER: &str = r#"
INSERT INTO chat_users (tenant, user_id, last_seq, version, message_count, last_created_at)
VALUES (?1, ?2, 0, 0, 0, ?3)
ON CONFLICT (tenant, user_id) DO UPDATE SET version = version
RETURNING last_seq, version, message_count, last_created_at, transcript_digest
"#;

const FINISH_SAVE: &str = r#"
UPDATE chat_users SET
    last_seq = last_seq + ?3,
    version = version + 1,
    message_count = ?4,
    last_created_at = ?5,
    oldest_at = (SELECT created_at FROM chat_messages m
                 WHERE m.tenant = chat_users.tenant AND m.user_id = chat_users.user_id
                 ORDER BY seq LIMIT 1),
    transcript_digest = ?6
WHERE tenant = ?1 AND user_id = ?2
RETURNING version
"#;

/// The first stored message (position from 1, and `seq`) that differs from
/// the incoming transcript, whose digests are `?3` laid end to end and whose
/// length is `?4`; none when the stored transcript is a prefix of it.
const FIRST_DIFFERENCE: &str = r#"
SELECT pos, seq FROM (
    SELECT seq, digest, row_number() OVER (ORDER BY seq) AS pos
    FROM chat_messages WHERE tenant = ?1 AND user_id = ?2)
WHERE pos > ?4 OR digest IS NOT substr(?3, (pos - 1) * 16 + 1, 16)
ORDER BY pos LIMIT 1
"#;

/// Deletes up to `?4` messages older than `?3` of the users in the JSON
/// array `?2`, naming the user of each.
const DELETE_EXPIRED: &str = r#"
DELETE FROM chat_messages WHERE rowid IN (
    SELECT rowid FROM chat_messages
    WHERE tenant = ?1 AND user_id IN (SELECT value FROM json_each(?2)) AND created_at < ?3
    LIMIT ?4)
RETURNING user_id
"#;

const REFRESH_OLDEST: &str = r#"
UPDATE chat_users SET oldest_at = (
    SELECT created_at FROM chat_messages m
    WHERE m.tenant = chat_users.tenant AND m.user_id = chat_users.user_id
    ORDER BY seq LIMIT 1)
WHERE tenant = ?1 AND user_id IN (SELECT value FROM json_each(?2))
"#;

const EVICT_OLDEST: &str = r#"
DELETE FROM chat_messages
WHERE tenant = ?1 AND user_id = ?2 AND seq IN (
    SELECT seq FROM chat_messages WHERE tenant = ?1 AND user_id = ?2
    ORDER BY seq LIMIT ?3)
"#;

const PAGE_BACK: &str = r#"
SELECT seq, created_at, message FROM chat_messages
WHERE tenant = ?1 AND user_id = ?2 AND seq < ?3
ORDER BY seq DESC LIMIT ?4
"#;

/// Where the age window of a user starts: the smallest `seq` whose
/// `created_at` is inside it, found through `chat_messages_age`.
const WINDOW_START: &str = r#"
SELECT seq FROM chat_messages
WHERE tenant = ?1 AND user_id = ?2 AND created_at >= ?3
ORDER BY created_at, seq LIMIT 1
"#;

/// Oldest first from `?3` (exclusive) below `?4`. SQLite does not turn a
/// subquery bound into an index range, so the window start is found first.
const PAGE_FORWARD: &str = r#"
SELECT seq, created_at, message FROM chat_messages
WHERE tenant = ?1 AND user_id = ?2 AND seq > ?3 AND seq < ?4
ORDER BY seq LIMIT ?5
"#;

const STATS: &str = r#"
SELECT message_count, version, first_seq, last_seq,
    (SELECT created_at FROM chat_messages m
     WHERE m.tenant = s.tenant AND m.user_id = s.user_id AND m.seq = s.first_seq) AS oldest_at,
    (SELECT created_at FROM chat_messages m
     WHERE m.tenant = s.tenant AND m.user_id = s.user_id AND m.seq = s.last_seq) AS newest_at
FROM (
    SELECT u.tenant, u.user_id, u.message_count, u.version,
        (SELECT seq FROM chat_messages m WHERE m.tenant = u.tenant AND m.user_id = u.user_id
         ORDER BY seq LIMIT 1) AS first_seq,
        (SELECT seq FROM chat_messages m WHERE m.tenant = u.tenant AND m.user_id = u.user_id
         ORDER BY seq DESC LIMIT 1) AS last_seq
    FROM chat_users u WHERE u.tenant = ?1 AND u.user_id = ?2
) s
WHERE first_seq IS NOT NULL
"#;

const LIST_USERS: &str = r#"
SELECT u.user_id, u.message_count,
    (SELECT created_at FROM chat_messages m WHERE m.tenant = u.tenant AND m.user_id = u.user_id
     ORDER BY seq DESC LIMIT 1) AS newest_at
FROM chat_users u
WHERE u.tenant = ?1 AND u.user_id > ?2 AND u.message_count > 0
ORDER BY u.user_id LIMIT ?3
"#;

/// `INSERT … VALUES` for `rows` messages of one user: ?1 tenant, ?2 user_id,
/// ?3 created_at, then seq, message and digest for each row.
fn insert_messages_sql(rows: usize) -> String {
    let mut sql = String::from(
        "INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest) VALUES ",
    );
    for i in 0..rows {
        let p = 4 + 3 * i;
        if i > 0 {
            sql.push(',');
        }
        sql.push_str(&format!("(?1, ?2, ?{p}, ?3, ?{}, ?{})", p + 1, p + 2));
    }
    sql
}

/// Inserts `messages` with consecutive `seq` from `first_seq`.
async fn insert_messages(
    tx: &mut Transaction<'_, Sqlite>,
    tenant: &Tenant,
    user: &UserId,
    first_seq: i64,
    created_at: i64,
    messages: &[NewMessage],
) -> Result<(), StoreError> {
    for (chunk_index, chunk) in messages.chunks(INSERT_CHUNK).enumerate() {
        let sql = insert_messages_sql(chunk.len());
        let mut insert = sqlx::query(&sql)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(created_at);
        let chunk_first = first_seq + db_count(chunk_index * INSERT_CHUNK);
        for (message, seq) in chunk.iter().zip(chunk_first..) {
            insert = insert
                .bind(seq)
                .bind(message.body())
                .bind(message.digest().to_vec());
        }
        insert.execute(&mut **tx).await?;
    }
    Ok(())
}

/// Deletes the user's `excess` oldest messages (if any) and takes them off
/// the count; says how many went.
async fn evict_oldest(
    tx: &mut Transaction<'_, Sqlite>,
    tenant: &Tenant,
    user: &UserId,
    excess: i64,
) -> Result<u64, StoreError> {
    if excess <= 0 {
        return Ok(0);
    }
    let evicted = sqlx::query(EVICT_OLDEST)
        .bind(tenant.as_str())
        .bind(user.as_str())
        .bind(excess)
        .execute(&mut **tx)
        .await?
        .rows_affected();
    sqlx::query(
        "UPDATE chat_users SET message_count = message_count - ?3, transcript_digest = NULL
         WHERE tenant = ?1 AND user_id = ?2",
    )
    .bind(tenant.as_str())
    .bind(user.as_str())
    .bind(db_count(evicted))
    .execute(&mut **tx)
    .await?;
    Ok(evicted)
}

/// Names as a JSON array, for `json_each` (SQLite has no array binds).
fn json_list(names: &[String]) -> String {
    serde_json::to_string(names).unwrap_or_else(|_| "[]".into())
}

#[async_trait]
impl Store for SqliteStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        MIGRATOR.run(&self.writer).await?;
        Ok(())
    }

    async fn ready(&self) -> Result<(), StoreError> {
        let applied: Option<i64> =
            sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
                .fetch_one(&self.reader)
                .await
                .or_else(|e| match e {
                    sqlx::Error::Database(db) if db.message().contains("no such table") => Ok(None),
                    other => Err(other),
                })?;
        let expected = latest_version(&MIGRATOR);
        if applied.is_some_and(|v| v >= expected) {
            Ok(())
        } else {
            Err(StoreError::NotMigrated { applied, expected })
        }
    }

    async fn append_messages(
        &self,
        tenant: &Tenant,
        user: &UserId,
        messages: &[NewMessage],
        now: Timestamp,
        cap: Option<u64>,
        idempotency: Option<&Idempotency>,
    ) -> Result<AppendOutcome, StoreError> {
        let count = db_count(messages.len());
        let mut tx = self.write().await?;
        if let Some(key) = idempotency {
            let seen = sqlx::query(
                "SELECT request_digest, first_seq, created_at, version FROM chat_idempotency
                 WHERE tenant = ?1 AND user_id = ?2 AND key = ?3",
            )
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(key.key())
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(seen) = seen {
                tx.commit().await?;
                return SeenKey {
                    request_digest: seen.try_get("request_digest")?,
                    first_seq: seen.try_get("first_seq")?,
                    created_at: at(seen.try_get("created_at")?),
                    version: seen.try_get("version")?,
                }
                .outcome(key, messages);
            }
        }
        let row = sqlx::query(UPSERT_USER)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(count)
            .bind(now.as_micros())
            .fetch_one(&mut *tx)
            .await?;
        let last_seq: i64 = row.try_get("last_seq")?;
        let created_at: i64 = row.try_get("last_created_at")?;
        let first_seq = last_seq - count + 1;
        insert_messages(&mut tx, tenant, user, first_seq, created_at, messages).await?;
        if let Some(cap) = cap {
            evict_oldest(
                &mut tx,
                tenant,
                user,
                row.try_get::<i64, _>("message_count")? - db_count(cap),
            )
            .await?;
        }
        let version: i64 = row.try_get("version")?;
        if let Some(key) = idempotency {
            sqlx::query(
                "INSERT INTO chat_idempotency
                    (tenant, user_id, key, request_digest, first_seq, created_at, version, stored_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(key.key())
            .bind(key.request_digest().to_vec())
            .bind(first_seq)
            .bind(created_at)
            .bind(version)
            .bind(now.as_micros())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(AppendOutcome::Stored(appended(
            messages,
            first_seq,
            at(created_at),
            version,
        )?))
    }

    async fn transcript_stream(
        &self,
        tenant: &Tenant,
        user: &UserId,
        deadline: Duration,
    ) -> Result<TranscriptStream, StoreError> {
        // The deadline covers the wait for a slot and the whole read.
        let until = tokio::time::Instant::now() + deadline;
        let slot = self.streams.take(until).await?;
        // A read transaction on a WAL reader sees one snapshot throughout.
        let tx = self.reader.begin().await?;
        stream_transcript(true, tx, slot, tenant, user, until).await
    }

    async fn save_transcript(
        &self,
        tenant: &Tenant,
        user: &UserId,
        messages: &[NewMessage],
        if_match: Option<&IfMatch>,
        now: Timestamp,
        cap: Option<u64>,
        max_removed: usize,
    ) -> Result<SaveOutcome, StoreError> {
        let mut tx = self.write().await?;
        let counters = sqlx::query(LOCK_USER)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(now.as_micros())
            .fetch_one(&mut *tx)
            .await?;
        let version: i64 = counters.try_get("version")?;
        if let Some(condition) = if_match {
            if !condition.admits(version, counters.try_get("message_count")?) {
                tx.rollback().await?;
                return Ok(SaveOutcome::PreconditionFailed {
                    current_version: version,
                });
            }
        }
        let stored = row_count(counters.try_get("message_count")?);
        // At most `messages.len()` can be kept: refuse before comparing.
        if let Some(refused) = removes_too_many(stored, messages.len(), max_removed) {
            tx.rollback().await?;
            return Ok(refused);
        }
        let known: Option<Vec<u8>> = counters.try_get("transcript_digest")?;
        let extends = extends_saved(known.as_deref(), stored, messages);
        let difference: Option<(i64, i64)> = if extends {
            // What the last save stored is a prefix of this transcript.
            None
        } else {
            let incoming: Vec<u8> = messages.iter().flat_map(|m| m.digest()).collect();
            sqlx::query_as(FIRST_DIFFERENCE)
                .bind(tenant.as_str())
                .bind(user.as_str())
                .bind(incoming)
                .bind(db_count(messages.len()))
                .fetch_optional(&mut *tx)
                .await?
        };
        let kept = difference.map_or(stored, |(pos, _)| row_count(pos) - 1);
        if let Some(refused) = removes_too_many(stored, kept, max_removed) {
            tx.rollback().await?;
            return Ok(refused);
        }
        if kept == stored && kept == messages.len() {
            tx.rollback().await?;
            return Ok(saved(version, stored, messages.len(), kept, 0));
        }
        if let Some((_, first_removed)) = difference {
            sqlx::query(
                "DELETE FROM chat_messages WHERE tenant = ?1 AND user_id = ?2 AND seq >= ?3",
            )
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(first_removed)
            .execute(&mut *tx)
            .await?;
        }
        let new = &messages[kept..];
        let created_at = now.as_micros().max(counters.try_get("last_created_at")?);
        let last_seq: i64 = counters.try_get("last_seq")?;
        insert_messages(&mut tx, tenant, user, last_seq + 1, created_at, new).await?;
        let version: i64 = sqlx::query_scalar(FINISH_SAVE)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(db_count(new.len()))
            .bind(db_count(messages.len()))
            .bind(created_at)
            .bind(transcript_digest(messages).to_vec())
            .fetch_one(&mut *tx)
            .await?;
        let evicted = match cap {
            Some(cap) => {
                evict_oldest(
                    &mut tx,
                    tenant,
                    user,
                    db_count(messages.len()) - db_count(cap),
                )
                .await?
            }
            None => 0,
        };
        tx.commit().await?;
        Ok(saved(version, stored, messages.len(), kept, evicted))
    }

    async fn purge_expired(&self, tenant: &Tenant, max_age: Duration) -> Result<u64, StoreError> {
        let cutoff = self.database_now().await?.minus_seconds(max_age.as_secs());
        self.purge_before(tenant, cutoff).await
    }

    async fn clear_all(&self, tenant: &Tenant) -> Result<u64, StoreError> {
        // User by user, each in batches, moving forward by key so that
        // appends arriving meanwhile cannot keep it going.
        let mut total = 0;
        let mut after = String::new();
        loop {
            let users: Vec<String> = sqlx::query_scalar(
                "SELECT user_id FROM chat_users WHERE tenant = ?1 AND user_id > ?2
                 AND message_count > 0 ORDER BY user_id LIMIT ?3",
            )
            .bind(tenant.as_str())
            .bind(&after)
            .bind(CLEAR_USERS_PER_BATCH)
            .fetch_all(&self.reader)
            .await?;
            let Some(last) = users.last() else {
                return Ok(total);
            };
            after = last.clone();
            for user in users {
                total += self.clear_user_on(tenant, &user).await?;
            }
        }
    }

    /// SQLite is one process's file, so no lock between replicas is needed.
    async fn retention_pass(
        &self,
        retention: Option<Duration>,
        keys_ttl: Duration,
    ) -> Result<Option<RetentionReport>, StoreError> {
        let now = self.database_now().await?;
        let mut report = RetentionReport::default();
        if let Some(retention) = retention {
            let cutoff = now.minus_seconds(retention.as_secs());
            let tenants: Vec<String> = sqlx::query_scalar(TENANTS).fetch_all(&self.reader).await?;
            for tenant in tenants {
                report.messages += self.purge_before(&Tenant::new(tenant), cutoff).await?;
            }
        }
        let keys_cutoff = now.minus_seconds(keys_ttl.as_secs());
        loop {
            let deleted = sqlx::query(
                "DELETE FROM chat_idempotency WHERE rowid IN (
                    SELECT rowid FROM chat_idempotency WHERE stored_at < ?1 LIMIT ?2)",
            )
            .bind(keys_cutoff.as_micros())
            .bind(KEYS_PER_BATCH)
            .execute(&self.writer)
            .await?
            .rows_affected();
            report.idempotency_keys += deleted;
            if deleted == 0 {
                return Ok(Some(report));
            }
        }
    }

    async fn history_window(
        &self,
        tenant: &Tenant,
        user: &UserId,
        query: HistoryQuery,
    ) -> Result<HistoryPage, StoreError> {
        let fetch = i64::from(query.limit) + 1;
        let before = query.before.unwrap_or(i64::MAX);
        let rows = match query.after {
            None => {
                sqlx::query(PAGE_BACK)
                    .bind(tenant.as_str())
                    .bind(user.as_str())
                    .bind(before)
                    .bind(fetch)
                    .fetch_all(&self.reader)
                    .await?
            }
            Some(after) => {
                let not_before = query.not_before.unwrap_or(Timestamp::from_micros(0));
                let window_start: Option<i64> = sqlx::query_scalar(WINDOW_START)
                    .bind(tenant.as_str())
                    .bind(user.as_str())
                    .bind(not_before.as_micros())
                    .fetch_optional(&self.reader)
                    .await?;
                let Some(window_start) = window_start else {
                    return Ok(HistoryPage {
                        messages: Vec::new(),
                        has_more: false,
                    });
                };
                sqlx::query(PAGE_FORWARD)
                    .bind(tenant.as_str())
                    .bind(user.as_str())
                    .bind(after.max(window_start - 1))
                    .bind(before)
                    .bind(fetch)
                    .fetch_all(&self.reader)
                    .await?
            }
        };
        let rows = rows
            .into_iter()
            .map(|r| {
                Ok((
                    r.try_get("seq")?,
                    at(r.try_get("created_at")?),
                    r.try_get("message")?,
                ))
            })
            .collect::<Result<_, StoreError>>()?;
        assemble_page(rows, query)
    }

    async fn message(
        &self,
        tenant: &Tenant,
        user: &UserId,
        seq: i64,
    ) -> Result<Option<StoredMessage>, StoreError> {
        let row = sqlx::query(
            "SELECT created_at, message FROM chat_messages \
             WHERE tenant = ?1 AND user_id = ?2 AND seq = ?3",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .bind(seq)
        .fetch_optional(&self.reader)
        .await?;
        row.map(|r| {
            StoredMessage::new(seq, at(r.try_get("created_at")?), r.try_get("message")?)
                .map_err(|e| StoreError::Corrupt(e.to_string()))
        })
        .transpose()
    }

    async fn delete_message(
        &self,
        tenant: &Tenant,
        user: &UserId,
        seq: i64,
    ) -> Result<bool, StoreError> {
        let mut tx = self.write().await?;
        let deleted = sqlx::query(
            "DELETE FROM chat_messages WHERE tenant = ?1 AND user_id = ?2 AND seq = ?3",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .bind(seq)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if deleted == 0 {
            return Ok(false);
        }
        sqlx::query(
            "UPDATE chat_users SET message_count = message_count - 1, version = version + 1,
             transcript_digest = NULL
             WHERE tenant = ?1 AND user_id = ?2",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn user_stats(
        &self,
        tenant: &Tenant,
        user: &UserId,
    ) -> Result<Option<UserStats>, StoreError> {
        let row = sqlx::query(STATS)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .fetch_optional(&self.reader)
            .await?;
        row.map(|r| {
            Ok(UserStats {
                message_count: r.try_get("message_count")?,
                first_seq: r.try_get("first_seq")?,
                last_seq: r.try_get("last_seq")?,
                oldest_at: at(r.try_get("oldest_at")?),
                newest_at: at(r.try_get("newest_at")?),
                version: r.try_get("version")?,
            })
        })
        .transpose()
    }

    async fn clear_user(&self, tenant: &Tenant, user: &UserId) -> Result<u64, StoreError> {
        self.clear_user_on(tenant, user.as_str()).await
    }

    async fn list_users(
        &self,
        tenant: &Tenant,
        after: Option<&UserId>,
        limit: u32,
    ) -> Result<(Vec<UserSummary>, bool), StoreError> {
        let rows = sqlx::query(LIST_USERS)
            .bind(tenant.as_str())
            .bind(after.map_or("", UserId::as_str))
            .bind(i64::from(limit) + 1)
            .fetch_all(&self.reader)
            .await?;
        let rows = rows
            .into_iter()
            .map(|r| {
                Ok((
                    r.try_get("user_id")?,
                    r.try_get("message_count")?,
                    at(r.try_get("newest_at")?),
                ))
            })
            .collect::<Result<_, StoreError>>()?;
        users_page(rows, limit)
    }

    fn pool_status(&self) -> PoolStatus {
        let (writer, reader) = (PoolStatus::of(&self.writer), PoolStatus::of(&self.reader));
        PoolStatus {
            in_use: writer.in_use + reader.in_use,
            idle: writer.idle + reader.idle,
        }
    }

    async fn close(&self) {
        self.writer.close().await;
        self.reader.close().await;
    }
}
