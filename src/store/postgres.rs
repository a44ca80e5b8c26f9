//! The production store. An append is one statement (a CTE that bumps the
//! user's counters and inserts the batch), which locks the user's row first;
//! every other write to a user takes that lock as its first statement.
//!
//! Behind a pooler in transaction mode (`?pool_mode=transaction`: PgBouncer
//! and the like) a server connection is ours only until the transaction
//! ends, so statements go unnamed (no prepared statement outlives its
//! transaction) and each runs inside a transaction. For the same reason the
//! retention lock is a lease row, not a session lock, in every mode.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use secrecy::ExposeSecret;
use sqlx::migrate::Migrator;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{Connection, FromRow, PgConnection, Postgres, Row, Transaction};

use super::{
    appended, assemble_page, db_count, latest_version, removes_too_many, row_count, saved,
    stream_transcript, users_page, ConnectOptions, DatabaseUrl, PoolMode, PoolStatus,
    RetentionReport, SeenKey, Store, StoreError, StreamSlots, TranscriptStream,
    CLEAR_USERS_PER_BATCH, KEYS_PER_BATCH, PURGE_USERS_PER_BATCH, TENANTS,
};
use crate::domain::{
    extends_saved, transcript_digest, AppendOutcome, HistoryPage, HistoryQuery, Idempotency,
    IfMatch, NewMessage, SaveOutcome, StoredMessage, Tenant, Timestamp, UserId, UserStats,
    UserSummary,
};

/// Messages deleted per retention transaction, at most.
const PURGE_ROWS_PER_BATCH: i64 = 1000;

/// How long a retention lease lasts unless renewed; each batch renews it,
/// and a replica that dies holding it delays the next run by at most this.
const RETENTION_LEASE_SECONDS: i64 = 120;

/// The lease that lets one replica at a time run retention.
const RETENTION_LEASE: &str = "retention";

/// Takes the lease `$1` for holder `$2` for `$3` seconds, by the database's
/// clock: when nobody holds it, when it has expired, or to renew our own.
const TAKE_LEASE: &str = r#"
INSERT INTO chat_leases AS l (name, holder, expires_at)
VALUES ($1, $2, now() + make_interval(secs => $3))
ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
WHERE l.expires_at < now() OR l.holder = EXCLUDED.holder
"#;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

pub struct PostgresStore {
    pool: PgPool,
    streams: StreamSlots,
    /// Named, cached statements; false behind a pooler in transaction mode.
    prepared: bool,
    /// Who holds the retention lease when this process does.
    holder: String,
}

/// A statement; unnamed unless `prepared` (see the module's doc).
fn query(prepared: bool, sql: &str) -> Query<'_, Postgres, PgArguments> {
    sqlx::query(sql).persistent(prepared)
}

fn query_scalar<O>(prepared: bool, sql: &str) -> QueryScalar<'_, Postgres, O, PgArguments>
where
    (O,): for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_scalar(sql).persistent(prepared)
}

fn query_as<O>(prepared: bool, sql: &str) -> QueryAs<'_, Postgres, O, PgArguments>
where
    O: for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_as(sql).persistent(prepared)
}

/// A connection for statements that need no transaction of their own: a
/// plain pool connection, or behind a transaction-mode pooler a transaction,
/// so that a statement's parse and execute reach the same server connection.
enum Session {
    Direct(PoolConnection<Postgres>),
    Pinned(Transaction<'static, Postgres>),
}

impl Session {
    fn conn(&mut self) -> &mut PgConnection {
        match self {
            Self::Direct(conn) => conn,
            Self::Pinned(tx) => tx,
        }
    }

    async fn done(self) -> Result<(), StoreError> {
        if let Self::Pinned(tx) = self {
            tx.commit().await?;
        }
        Ok(())
    }
}

impl PostgresStore {
    pub fn connect(url: &DatabaseUrl, options: ConnectOptions) -> Result<Self, StoreError> {
        let parts = url.for_postgres().map_err(StoreError::BadUrl)?;
        parts.check_files().map_err(StoreError::BadUrl)?;
        for parameter in parts.dropped {
            tracing::warn!("DATABASE_URL: ignoring the parameter {parameter:?}, which the Postgres driver does not know");
        }
        let prepared = parts.pool_mode == PoolMode::Session;
        let mut connect =
            PgConnectOptions::from_str(parts.url.expose_secret())?.application_name("chat-history");
        if !prepared {
            connect = connect.statement_cache_capacity(0);
        }
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            .connect_lazy_with(connect);
        Ok(Self {
            pool,
            streams: StreamSlots::new(options.max_connections),
            prepared,
            holder: lease_holder(),
        })
    }

    /// A connection for start-up work. When the pool gives up waiting for
    /// one, a direct attempt finds out why (refused, unknown host, TLS,
    /// authentication): the pool's own error says only that it timed out.
    async fn first_connection(&self) -> Result<PoolConnection<Postgres>, StoreError> {
        match self.pool.acquire().await {
            Err(sqlx::Error::PoolTimedOut) => {
                let cause = PgConnection::connect_with(&self.pool.connect_options())
                    .await
                    .err()
                    .unwrap_or(sqlx::Error::PoolTimedOut);
                Err(cause.into())
            }
            acquired => Ok(acquired?),
        }
    }

    async fn session(&self) -> Result<Session, StoreError> {
        Ok(if self.prepared {
            Session::Direct(self.pool.acquire().await?)
        } else {
            Session::Pinned(self.pool.begin().await?)
        })
    }

    /// Takes or renews the retention lease for `RETENTION_LEASE_SECONDS`;
    /// false while another replica holds it.
    async fn take_lease(&self, conn: &mut PgConnection) -> Result<bool, StoreError> {
        let mut tx = conn.begin().await?;
        let taken = query(self.prepared, TAKE_LEASE)
            .bind(RETENTION_LEASE)
            .bind(&self.holder)
            .bind(RETENTION_LEASE_SECONDS)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(taken == 1)
    }

    async fn release_lease(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        let mut tx = conn.begin().await?;
        query(
            self.prepared,
            "DELETE FROM chat_leases WHERE name = $1 AND holder = $2",
        )
        .bind(RETENTION_LEASE)
        .bind(&self.holder)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The single-statement append (see `APPEND`).
    fn append_query<'q>(
        &self,
        tenant: &'q Tenant,
        user: &'q UserId,
        messages: &'q [NewMessage],
        now: Timestamp,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        let (bodies, digests) = columns(messages);
        query(self.prepared, APPEND)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(db_count(messages.len()))
            .bind(now.to_datetime())
            .bind(bodies)
            .bind(digests)
    }

    /// The fast path of a save that only adds messages to what the last
    /// save stored: two round trips, no lock held between them. `None` when
    /// it does not apply (or lost a race); the caller then takes the locked path.
    async fn extend_transcript(
        &self,
        tenant: &Tenant,
        user: &UserId,
        messages: &[NewMessage],
        if_match: Option<&IfMatch>,
        now: Timestamp,
    ) -> Result<Option<SaveOutcome>, StoreError> {
        let mut session = self.session().await?;
        let Some(row) = query(
            self.prepared,
            "SELECT version, message_count, transcript_digest FROM chat_users
             WHERE tenant = $1 AND user_id = $2",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .fetch_optional(session.conn())
        .await?
        else {
            session.done().await?;
            return Ok(None);
        };
        let version: i64 = row.try_get("version")?;
        let stored = row_count(row.try_get("message_count")?);
        let known: Option<Vec<u8>> = row.try_get("transcript_digest")?;
        let extends = extends_saved(known.as_deref(), stored, messages);
        let admitted = if_match.is_none_or(|c| c.admits(version, db_count(stored)));
        session.done().await?;
        if !extends || !admitted {
            return Ok(None);
        }
        let new = &messages[stored..];
        if new.is_empty() {
            return Ok(Some(saved(version, stored, messages.len(), stored, 0)));
        }
        let mut session = self.session().await?;
        let (bodies, digests) = columns(new);
        let version: Option<i64> = query_scalar(self.prepared, EXTEND_IF_UNCHANGED)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(db_count(new.len()))
            .bind(now.to_datetime())
            .bind(bodies)
            .bind(digests)
            .bind(&transcript_digest(messages)[..])
            .bind(version)
            .fetch_optional(session.conn())
            .await?;
        session.done().await?;
        Ok(version.map(|version| saved(version, stored, messages.len(), stored, 0)))
    }
}

/// The digests of `messages` laid end to end, 16 bytes each.
fn concatenated_digests(messages: &[NewMessage]) -> Vec<u8> {
    messages.iter().flat_map(|m| m.digest()).collect()
}

/// The bodies and digests of `messages`, as two parallel arrays.
fn columns(messages: &[NewMessage]) -> (Vec<&str>, Vec<Vec<u8>>) {
    messages
        .iter()
        .map(|m| (m.body(), m.digest().to_vec()))
        .unzip()
}

/// The answer of an append from the row `APPEND` returned.
fn append_result(
    messages: &[NewMessage],
    row: &sqlx::postgres::PgRow,
) -> Result<crate::domain::Appended, StoreError> {
    let last_seq: i64 = row.try_get("last_seq")?;
    appended(
        messages,
        last_seq - db_count(messages.len()) + 1,
        at(row.try_get("last_created_at")?),
        row.try_get("version")?,
    )
}

/// Retention, purge and eviction: the batched deletes.
impl PostgresStore {
    /// Deletes the user's `excess` oldest messages (if any) inside `tx`, whose
    /// first statement locked the user, and says how many went.
    async fn evict_oldest(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        tenant: &Tenant,
        user: &UserId,
        excess: i64,
    ) -> Result<u64, StoreError> {
        if excess <= 0 {
            return Ok(0);
        }
        query(self.prepared, EVICT_OLDEST)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(excess)
            .execute(&mut **tx)
            .await?;
        Ok(u64::try_from(excess).unwrap_or(0))
    }

    /// The database's clock: cutoffs are taken from it, never from a replica's.
    async fn database_now(&self, conn: &mut PgConnection) -> Result<Timestamp, StoreError> {
        let mut tx = conn.begin().await?;
        let micros: i64 = query_scalar(
            self.prepared,
            "SELECT (extract(epoch FROM now()) * 1000000)::bigint",
        )
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Timestamp::from_micros(micros))
    }

    /// Deletes the tenant's messages created before `cutoff`, a bounded batch
    /// of users and rows per transaction, on `conn`. A `leased` purge (the
    /// retention run's) renews the lease after each batch and stops if it is lost.
    async fn purge_on(
        &self,
        conn: &mut PgConnection,
        tenant: &Tenant,
        cutoff: Timestamp,
        leased: bool,
    ) -> Result<u64, StoreError> {
        let prepared = self.prepared;
        let mut total = 0;
        loop {
            let mut tx = conn.begin().await?;
            let users: Vec<String> = query_scalar(prepared, LOCK_EXPIRED_USERS)
                .bind(tenant.as_str())
                .bind(cutoff.to_datetime())
                .bind(PURGE_USERS_PER_BATCH)
                .fetch_all(&mut *tx)
                .await?;
            if users.is_empty() {
                tx.commit().await?;
                return Ok(total);
            }
            let deleted: i64 = query_scalar(prepared, DELETE_EXPIRED)
                .bind(tenant.as_str())
                .bind(&users)
                .bind(cutoff.to_datetime())
                .bind(PURGE_ROWS_PER_BATCH)
                .fetch_one(&mut *tx)
                .await?;
            query(prepared, REFRESH_OLDEST)
                .bind(tenant.as_str())
                .bind(&users)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            total += u64::try_from(deleted).unwrap_or(0);
            if leased && !self.take_lease(conn).await? {
                return Ok(total);
            }
        }
    }

    /// One retention run on `conn`, whose store holds the retention lease
    /// and renews it after every batch; a lease lost (the run took longer than
    /// the lease without a batch ending) ends the run early.
    async fn retention_work(
        &self,
        conn: &mut PgConnection,
        retention: Option<Duration>,
        keys_ttl: Duration,
    ) -> Result<RetentionReport, StoreError> {
        let prepared = self.prepared;
        let now = self.database_now(conn).await?;
        let mut report = RetentionReport::default();
        if let Some(retention) = retention {
            let cutoff = now.minus_seconds(retention.as_secs());
            let mut tx = conn.begin().await?;
            let tenants: Vec<String> = query_scalar(prepared, TENANTS).fetch_all(&mut *tx).await?;
            tx.commit().await?;
            for tenant in tenants {
                report.messages += self
                    .purge_on(conn, &Tenant::new(tenant), cutoff, true)
                    .await?;
            }
        }
        let keys_cutoff = now.minus_seconds(keys_ttl.as_secs());
        loop {
            let mut tx = conn.begin().await?;
            let deleted = query(prepared, DELETE_OLD_KEYS)
                .bind(keys_cutoff.to_datetime())
                .bind(KEYS_PER_BATCH)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            report.idempotency_keys += deleted;
            if deleted == 0 || !self.take_lease(conn).await? {
                return Ok(report);
            }
        }
    }
}

/// Names this process (and store) as a lease holder, uniquely enough that
/// two replicas, or two stores in one process, never share a name.
fn lease_holder() -> String {
    static STORES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let host = std::env::var("HOSTNAME").unwrap_or_default();
    format!(
        "{host}/{}/{}/{}",
        std::process::id(),
        STORES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        Timestamp::now().to_datetime().timestamp_micros()
    )
}

fn at(time: DateTime<Utc>) -> Timestamp {
    Timestamp::from_datetime(time)
}

const APPEND: &str = r#"
WITH u AS (
    INSERT INTO chat_users AS u
        (tenant, user_id, last_seq, version, message_count, last_created_at, oldest_at)
    VALUES ($1, $2, $3, 1, $3, $4, $4)
    ON CONFLICT (tenant, user_id) DO UPDATE SET
        last_seq = u.last_seq + EXCLUDED.last_seq,
        version = u.version + 1,
        message_count = u.message_count + EXCLUDED.message_count,
        transcript_digest = NULL,
        last_created_at = GREATEST(u.last_created_at, EXCLUDED.last_created_at),
        oldest_at = CASE WHEN u.message_count = 0
            THEN GREATEST(u.last_created_at, EXCLUDED.last_created_at)
            ELSE u.oldest_at END
    RETURNING u.last_seq, u.version, u.last_created_at, u.message_count
), inserted AS (
    INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest)
    SELECT $1, $2, u.last_seq - $3 + m.ord, u.last_created_at, m.body, m.digest
    FROM u, unnest($5::text[], $6::bytea[]) WITH ORDINALITY AS m(body, digest, ord)
)
SELECT last_seq, version, last_created_at, message_count FROM u
"#;

/// Locks the user's row, creating it (version 0, no messages) if needed, and
/// reads its counters: the first statement of every multi-step write.
const LOCK_USER: &str = r#"
INSERT INTO chat_users AS u (tenant, user_id, last_seq, version, message_count, last_created_at)
VALUES ($1, $2, 0, 0, 0, $3)
ON CONFLICT (tenant, user_id) DO UPDATE SET version = u.version
RETURNING u.last_seq, u.version, u.message_count, u.last_created_at
"#;

/// The first stored message (its position from 1, and `seq`) that differs
/// from the incoming transcript, whose digests are `$3` laid end to end and
/// whose length is `$4`; none when the stored transcript is a prefix of it.
macro_rules! first_difference {
    () => {
        r#"
SELECT pos, seq FROM (
    SELECT seq, digest, row_number() OVER (ORDER BY seq) AS pos
    FROM chat_messages WHERE tenant = $1 AND user_id = $2) stored
WHERE pos > $4 OR digest <> substring($3 FROM ((pos - 1) * 16 + 1)::int FOR 16)
ORDER BY pos LIMIT 1
"#
    };
}

const FIRST_DIFFERENCE: &str = first_difference!();

/// `LOCK_USER` and `FIRST_DIFFERENCE` in one round trip. The comparison
/// reads the statement's snapshot, taken before the lock was granted; it
/// stands only if that snapshot holds the version the lock returned (every
/// write bumps it), which `snapshot_is_current` says.
const LOCK_AND_COMPARE: &str = concat!(
    r#"
WITH locked AS (
    INSERT INTO chat_users AS u (tenant, user_id, last_seq, version, message_count, last_created_at)
    VALUES ($1, $2, 0, 0, 0, $5)
    ON CONFLICT (tenant, user_id) DO UPDATE SET version = u.version
    RETURNING u.last_seq, u.version, u.message_count, u.last_created_at
), seen AS (
    SELECT coalesce(
        (SELECT version FROM chat_users WHERE tenant = $1 AND user_id = $2), 0) AS version
), difference AS ("#,
    first_difference!(),
    r#")
SELECT l.last_seq, l.version, l.message_count, l.last_created_at,
       s.version = l.version AS snapshot_is_current,
       d.pos AS differs_at, d.seq AS first_removed
FROM locked l CROSS JOIN seen s LEFT JOIN difference d ON true
"#
);

/// With the user locked: deletes from `seq` `$3` on, appends the new
/// messages after `$4`, and sets the counters; returns the new version.
const REPLACE_SUFFIX: &str = r#"
WITH gone AS (
    DELETE FROM chat_messages WHERE tenant = $1 AND user_id = $2 AND seq >= $3
), added AS (
    INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest)
    SELECT $1, $2, $4 + m.ord, $5, m.body, m.digest
    FROM unnest($6::text[], $7::bytea[]) WITH ORDINALITY AS m(body, digest, ord)
)
UPDATE chat_users SET
    last_seq = last_seq + $8,
    version = version + 1,
    message_count = $9,
    last_created_at = $5,
    oldest_at = CASE WHEN $9 = 0 THEN NULL WHEN $10 THEN $5 ELSE oldest_at END,
    transcript_digest = $11
WHERE tenant = $1 AND user_id = $2
RETURNING version
"#;

/// `APPEND` for a transcript save that only adds messages, done only if the
/// user is still at version `$8` (checked again after any wait for its row):
/// otherwise it changes nothing and returns no row.
const EXTEND_IF_UNCHANGED: &str = r#"
WITH u AS (
    UPDATE chat_users u SET
        last_seq = u.last_seq + $3,
        version = u.version + 1,
        message_count = u.message_count + $3,
        last_created_at = GREATEST(u.last_created_at, $4),
        oldest_at = CASE WHEN u.message_count = 0
            THEN GREATEST(u.last_created_at, $4) ELSE u.oldest_at END,
        transcript_digest = $7
    WHERE u.tenant = $1 AND u.user_id = $2 AND u.version = $8
    RETURNING u.last_seq, u.version, u.last_created_at
), inserted AS (
    INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest)
    SELECT $1, $2, u.last_seq - $3 + m.ord, u.last_created_at, m.body, m.digest
    FROM u, unnest($5::text[], $6::bytea[]) WITH ORDINALITY AS m(body, digest, ord)
)
SELECT version FROM u
"#;

/// Locks, in key order, up to `$3` users of the tenant whose oldest message
/// may be older than `$2`.
const LOCK_EXPIRED_USERS: &str = r#"
SELECT user_id FROM chat_users
WHERE tenant = $1 AND user_id IN (
    SELECT user_id FROM chat_users
    WHERE tenant = $1 AND oldest_at < $2
    ORDER BY oldest_at LIMIT $3)
ORDER BY user_id
FOR UPDATE
"#;

/// Deletes up to `$4` messages older than `$3` of the locked users `$2`
/// and takes them off their counts.
const DELETE_EXPIRED: &str = r#"
WITH victims AS (
    SELECT user_id, seq FROM chat_messages
    WHERE tenant = $1 AND user_id = ANY($2) AND created_at < $3
    LIMIT $4
), gone AS (
    DELETE FROM chat_messages m USING victims v
    WHERE m.tenant = $1 AND m.user_id = v.user_id AND m.seq = v.seq
    RETURNING m.user_id
), counts AS (
    SELECT user_id, count(*) AS n FROM gone GROUP BY user_id
), updated AS (
    UPDATE chat_users u SET message_count = u.message_count - c.n, version = u.version + 1,
        transcript_digest = NULL
    FROM counts c
    WHERE u.tenant = $1 AND u.user_id = c.user_id
    RETURNING c.n
)
SELECT coalesce(sum(n), 0)::bigint FROM updated
"#;

const REFRESH_OLDEST: &str = r#"
UPDATE chat_users u SET oldest_at = (
    SELECT created_at FROM chat_messages m
    WHERE m.tenant = u.tenant AND m.user_id = u.user_id ORDER BY seq LIMIT 1)
WHERE u.tenant = $1 AND u.user_id = ANY($2)
"#;

/// By key columns rather than `ctid`, which a distributed table (Citus)
/// cannot route.
const DELETE_OLD_KEYS: &str = r#"
DELETE FROM chat_idempotency WHERE (tenant, user_id, key) IN (
    SELECT tenant, user_id, key FROM chat_idempotency WHERE stored_at < $1 LIMIT $2)
"#;

/// Deletes the user's `$3` oldest messages and takes them off the count.
const EVICT_OLDEST: &str = r#"
WITH gone AS (
    DELETE FROM chat_messages
    WHERE tenant = $1 AND user_id = $2 AND seq IN (
        SELECT seq FROM chat_messages
        WHERE tenant = $1 AND user_id = $2
        ORDER BY seq LIMIT $3)
    RETURNING 1
)
UPDATE chat_users SET message_count = message_count - (SELECT count(*) FROM gone),
    transcript_digest = NULL
WHERE tenant = $1 AND user_id = $2
"#;

/// Newest first, bounded by the primary key; the age filter is applied to
/// the result, which is a prefix because `created_at` follows `seq`.
const PAGE_BACK: &str = r#"
SELECT seq, created_at, message FROM chat_messages
WHERE tenant = $1 AND user_id = $2 AND seq < $3
ORDER BY seq DESC LIMIT $4
"#;

/// Oldest first after `$3`, starting no earlier than the first message
/// inside the age window (found once through `chat_messages_age`).
const PAGE_FORWARD: &str = r#"
SELECT seq, created_at, message FROM chat_messages
WHERE tenant = $1 AND user_id = $2 AND seq > $3 AND seq < $4
  AND seq >= (
    SELECT seq FROM chat_messages
    WHERE tenant = $1 AND user_id = $2 AND created_at >= $5
    ORDER BY created_at, seq LIMIT 1)
ORDER BY seq LIMIT $6
"#;

const STATS: &str = r#"
SELECT u.message_count, u.version, f.seq AS first_seq, f.created_at AS oldest_at,
       l.seq AS last_seq, l.created_at AS newest_at
FROM chat_users u
CROSS JOIN LATERAL (
    SELECT seq, created_at FROM chat_messages m
    WHERE m.tenant = u.tenant AND m.user_id = u.user_id ORDER BY seq LIMIT 1) f
CROSS JOIN LATERAL (
    SELECT seq, created_at FROM chat_messages m
    WHERE m.tenant = u.tenant AND m.user_id = u.user_id ORDER BY seq DESC LIMIT 1) l
WHERE u.tenant = $1 AND u.user_id = $2
"#;

const LIST_USERS: &str = r#"
SELECT u.user_id, u.message_count, l.created_at AS newest_at
FROM chat_users u
CROSS JOIN LATERAL (
    SELECT created_at FROM chat_messages m
    WHERE m.tenant = u.tenant AND m.user_id = u.user_id ORDER BY seq DESC LIMIT 1) l
WHERE u.tenant = $1 AND u.user_id > $2 AND u.message_count > 0
ORDER BY u.user_id LIMIT $3
"#;

#[async_trait]
impl Store for PostgresStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.first_connection().await?;
        if self.prepared {
            MIGRATOR.run_direct(&mut *conn).await?;
            return Ok(());
        }
        // Behind a transaction-mode pooler: the migrator's session lock and
        // named statements must not outlive our hold on the server
        // connection, so it runs inside one transaction, which drops every
        // prepared statement before it commits.
        let mut tx = conn.begin().await?;
        MIGRATOR.run_direct(&mut *tx).await?;
        query(false, "DEALLOCATE ALL").execute(&mut *tx).await?;
        tx.commit().await?;
        conn.close().await?;
        Ok(())
    }

    async fn ready(&self) -> Result<(), StoreError> {
        let mut session = self.session().await?;
        let applied: Option<i64> = query_scalar(
            self.prepared,
            "SELECT max(version) FROM _sqlx_migrations WHERE success",
        )
        .fetch_one(session.conn())
        .await
        .or_else(|e| match e {
            // No migrations table yet: reachable, but not migrated.
            sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => Ok(None),
            other => Err(other),
        })?;
        // A failed statement has aborted a pinned transaction: nothing to commit.
        if applied.is_some() {
            session.done().await?;
        }
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
        if cap.is_none() && idempotency.is_none() {
            // The common case: one statement, one round trip.
            let mut session = self.session().await?;
            let row = self
                .append_query(tenant, user, messages, now)
                .fetch_one(session.conn())
                .await?;
            session.done().await?;
            return Ok(AppendOutcome::Stored(append_result(messages, &row)?));
        }
        let mut tx = self.pool.begin().await?;
        if let Some(key) = idempotency {
            // Lock the user first: a concurrent request with the same key
            // waits here, then finds the record this one leaves.
            query(self.prepared, LOCK_USER)
                .bind(tenant.as_str())
                .bind(user.as_str())
                .bind(now.to_datetime())
                .execute(&mut *tx)
                .await?;
            let seen = query(
                self.prepared,
                "SELECT request_digest, first_seq, created_at, version FROM chat_idempotency
                 WHERE tenant = $1 AND user_id = $2 AND key = $3",
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
        let row = self
            .append_query(tenant, user, messages, now)
            .fetch_one(&mut *tx)
            .await?;
        if let Some(cap) = cap {
            self.evict_oldest(
                &mut tx,
                tenant,
                user,
                row.try_get::<i64, _>("message_count")? - db_count(cap),
            )
            .await?;
        }
        let result = append_result(messages, &row)?;
        if let Some(key) = idempotency {
            query(self.prepared,
                "INSERT INTO chat_idempotency
                    (tenant, user_id, key, request_digest, first_seq, created_at, version, stored_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            )
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(key.key())
            .bind(&key.request_digest()[..])
            .bind(result.messages[0].seq)
            .bind(result.messages[0].created_at.to_datetime())
            .bind(result.version)
            .bind(now.to_datetime())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(AppendOutcome::Stored(result))
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
        // One snapshot for the version and every row: REPEATABLE READ.
        let tx = self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await?;
        stream_transcript(self.prepared, tx, slot, tenant, user, until).await
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
        if cap.is_none_or(|cap| messages.len() as u64 <= cap) {
            if let Some(outcome) = self
                .extend_transcript(tenant, user, messages, if_match, now)
                .await?
            {
                return Ok(outcome);
            }
        }
        let incoming = concatenated_digests(messages);
        let mut tx = self.pool.begin().await?;
        let row = query(self.prepared, LOCK_AND_COMPARE)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(&incoming)
            .bind(db_count(messages.len()))
            .bind(now.to_datetime())
            .fetch_one(&mut *tx)
            .await?;
        let version: i64 = row.try_get("version")?;
        let stored = row_count(row.try_get("message_count")?);
        if let Some(condition) = if_match {
            if !condition.admits(version, db_count(stored)) {
                tx.rollback().await?;
                return Ok(SaveOutcome::PreconditionFailed {
                    current_version: version,
                });
            }
        }
        let difference: Option<(i64, i64)> = if row.try_get("snapshot_is_current")? {
            match row.try_get::<Option<i64>, _>("differs_at")? {
                Some(pos) => Some((pos, row.try_get("first_removed")?)),
                None => None,
            }
        } else {
            // Another write committed while this one waited for the lock:
            // compare again, now that the lock is held.
            query_as(self.prepared, FIRST_DIFFERENCE)
                .bind(tenant.as_str())
                .bind(user.as_str())
                .bind(&incoming)
                .bind(db_count(messages.len()))
                .fetch_optional(&mut *tx)
                .await?
        };
        let kept = difference.map_or(stored, |(pos, _)| row_count(pos) - 1);
        if let Some(refused) = removes_too_many(stored, kept, max_removed) {
            tx.rollback().await?;
            return Ok(refused);
        }
        let new = &messages[kept..];
        if kept == stored && new.is_empty() {
            tx.rollback().await?;
            return Ok(saved(version, stored, messages.len(), kept, 0));
        }
        let (bodies, digests) = columns(new);
        let created_at = now.max(at(row.try_get("last_created_at")?));
        let version: i64 = query_scalar(self.prepared, REPLACE_SUFFIX)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(difference.map_or(i64::MAX, |(_, seq)| seq))
            .bind(row.try_get::<i64, _>("last_seq")?)
            .bind(created_at.to_datetime())
            .bind(bodies)
            .bind(digests)
            .bind(db_count(new.len()))
            .bind(db_count(messages.len()))
            .bind(kept == 0)
            .bind(&transcript_digest(messages)[..])
            .fetch_one(&mut *tx)
            .await?;
        let evicted = match cap {
            Some(cap) => {
                self.evict_oldest(
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
        let mut conn = self.pool.acquire().await?;
        let cutoff = self
            .database_now(&mut conn)
            .await?
            .minus_seconds(max_age.as_secs());
        self.purge_on(&mut conn, tenant, cutoff, false).await
    }

    async fn clear_all(&self, tenant: &Tenant) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let mut tx = self.pool.begin().await?;
            let users: Vec<String> = query_scalar(
                self.prepared,
                "SELECT user_id FROM chat_users WHERE tenant = $1 AND message_count > 0
                 ORDER BY user_id LIMIT $2 FOR UPDATE",
            )
            .bind(tenant.as_str())
            .bind(CLEAR_USERS_PER_BATCH)
            .fetch_all(&mut *tx)
            .await?;
            if users.is_empty() {
                tx.commit().await?;
                return Ok(total);
            }
            total += query(
                self.prepared,
                "DELETE FROM chat_messages WHERE tenant = $1 AND user_id = ANY($2)",
            )
            .bind(tenant.as_str())
            .bind(&users)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            query(
                self.prepared,
                "UPDATE chat_users SET version = version + 1, message_count = 0, oldest_at = NULL,
                     transcript_digest = NULL
                 WHERE tenant = $1 AND user_id = ANY($2)",
            )
            .bind(tenant.as_str())
            .bind(&users)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        }
    }

    async fn retention_pass(
        &self,
        retention: Option<Duration>,
        keys_ttl: Duration,
    ) -> Result<Option<RetentionReport>, StoreError> {
        // One connection does the whole run, so it works on a pool of one.
        // The lock is a lease row, not a session lock: it must hold behind a
        // pooler in transaction mode too, where no session is ours for long.
        let mut conn = self.pool.acquire().await?;
        if !self.take_lease(&mut conn).await? {
            return Ok(None);
        }
        let report = self.retention_work(&mut conn, retention, keys_ttl).await;
        let released = self.release_lease(&mut conn).await;
        let report = report?;
        released?;
        Ok(Some(report))
    }

    async fn history_window(
        &self,
        tenant: &Tenant,
        user: &UserId,
        query: HistoryQuery,
    ) -> Result<HistoryPage, StoreError> {
        let fetch = i64::from(query.limit) + 1;
        let before = query.before.unwrap_or(i64::MAX);
        let mut session = self.session().await?;
        let rows = match query.after {
            None => {
                sqlx::query(PAGE_BACK)
                    .persistent(self.prepared)
                    .bind(tenant.as_str())
                    .bind(user.as_str())
                    .bind(before)
                    .bind(fetch)
                    .fetch_all(session.conn())
                    .await?
            }
            Some(after) => {
                let not_before = query.not_before.unwrap_or(Timestamp::from_micros(0));
                sqlx::query(PAGE_FORWARD)
                    .persistent(self.prepared)
                    .bind(tenant.as_str())
                    .bind(user.as_str())
                    .bind(after)
                    .bind(before)
                    .bind(not_before.to_datetime())
                    .bind(fetch)
                    .fetch_all(session.conn())
                    .await?
            }
        };
        session.done().await?;
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
        let mut session = self.session().await?;
        let row = query(
            self.prepared,
            "SELECT created_at, message FROM chat_messages \
             WHERE tenant = $1 AND user_id = $2 AND seq = $3",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .bind(seq)
        .fetch_optional(session.conn())
        .await?;
        session.done().await?;
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
        let mut tx = self.pool.begin().await?;
        let locked = query(
            self.prepared,
            "SELECT 1 FROM chat_users WHERE tenant = $1 AND user_id = $2 FOR UPDATE",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        if locked.is_none() {
            return Ok(false);
        }
        let deleted = query(
            self.prepared,
            "WITH gone AS (
                DELETE FROM chat_messages WHERE tenant = $1 AND user_id = $2 AND seq = $3
                RETURNING 1)
             UPDATE chat_users SET message_count = message_count - 1, version = version + 1,
                 transcript_digest = NULL
             WHERE tenant = $1 AND user_id = $2 AND EXISTS (SELECT 1 FROM gone)",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .bind(seq)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(deleted == 1)
    }

    async fn user_stats(
        &self,
        tenant: &Tenant,
        user: &UserId,
    ) -> Result<Option<UserStats>, StoreError> {
        let mut session = self.session().await?;
        let row = query(self.prepared, STATS)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .fetch_optional(session.conn())
            .await?;
        session.done().await?;
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
        let mut tx = self.pool.begin().await?;
        let had_messages = query(
            self.prepared,
            "UPDATE chat_users SET version = version + 1, message_count = 0, oldest_at = NULL,
                     transcript_digest = NULL
             WHERE tenant = $1 AND user_id = $2 AND message_count > 0",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if had_messages == 0 {
            return Ok(0);
        }
        let deleted = query(
            self.prepared,
            "DELETE FROM chat_messages WHERE tenant = $1 AND user_id = $2",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(deleted)
    }

    async fn list_users(
        &self,
        tenant: &Tenant,
        after: Option<&UserId>,
        limit: u32,
    ) -> Result<(Vec<UserSummary>, bool), StoreError> {
        let mut session = self.session().await?;
        let rows = query(self.prepared, LIST_USERS)
            .bind(tenant.as_str())
            .bind(after.map_or("", UserId::as_str))
            .bind(i64::from(limit) + 1)
            .fetch_all(session.conn())
            .await?;
        session.done().await?;
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
        PoolStatus::of(&self.pool)
    }

    async fn close(&self) {
        self.pool.close().await;
    }
}
