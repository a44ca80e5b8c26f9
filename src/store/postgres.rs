//! The production store's dialect: what Postgres says differently from the
//! shared SQL in `sql.rs`. An append is one statement (a CTE that bumps the
//! user's counters, locking its row, and inserts the batch from arrays);
//! lists of users bind as arrays; multi-step writes lock rows `FOR UPDATE`.
//!
//! Behind a pooler in transaction mode (`?pool_mode=transaction`: PgBouncer
//! and the like) a server connection is ours only until the transaction
//! ends, so statements go unnamed (no prepared statement outlives its
//! transaction) and each runs inside a transaction. For the same reason the
//! retention lock is a lease row, not a session lock, in every mode.

use std::str::FromStr;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use secrecy::ExposeSecret;
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgArgumentBuffer, PgConnectOptions, PgQueryResult, PgTypeInfo, PgValueRef};
use sqlx::{Connection, Decode, Encode, Executor, FromRow, PgConnection, Pool, Postgres, Type};

use super::batch::{Append, PageBack};
use super::fold::{slot_number, Final, Fold};
use super::recent::{Mark, RecentPages};
use super::sql::{CheckedPage, Counters, Dialect, SqlStore, BATCH_PAGE_BUDGETS};
use super::{
    body, db_count, pool_options, ConnectOptions, DatabaseUrl, MessageRecord, Page, PageRow,
    PoolMode, StoreError,
};
use crate::domain::{NewMessage, Tenant, Timestamp, UserId};

pub type PostgresStore = SqlStore<Postgres>;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

pub fn connect(url: &DatabaseUrl, options: ConnectOptions) -> Result<PostgresStore, StoreError> {
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
    let mut pool = pool_options::<Postgres>(options.max_connections, &options);
    if prepared {
        pool = pool.after_connect(|conn, _| {
            Box::pin(async move { plan_once(conn.execute(PLAN_ONCE).await) })
        });
    }
    // Lazily, so that the service can start before its database.
    let pool = pool.connect_lazy_with(connect);
    Ok(SqlStore::new(pool, None, prepared, &options).with_batching(
        options.commit_batch,
        (options.read_cache_bytes > 0)
            .then(|| Arc::new(RecentPages::new(options.read_cache_bytes))),
    ))
}

/// Tells a new session to plan each named statement once, for any values.
/// Left to itself, Postgres plans a named statement for its values on each
/// of its first five runs, and on every run one that takes a batch as
/// arrays (a plan for arrays of unknown length looks dearer to it than one
/// for the lengths at hand), which costs about as much as running it. Ours
/// are all lookups by a user's key, which one plan serves. Behind a pooler
/// in transaction mode the session is not ours to set, and statements are
/// unnamed, planned on each run anyway: this is not sent there.
const PLAN_ONCE: &str = "SET plan_cache_mode = force_generic_plan";

/// What `PLAN_ONCE` did: a server that does not know the setting (before
/// Postgres 12) plans as it always did.
fn plan_once(set: Result<PgQueryResult, sqlx::Error>) -> Result<(), sqlx::Error> {
    match set {
        Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("42704") => Ok(()),
        other => other.map(drop),
    }
}

#[async_trait]
impl Dialect for Postgres {
    const BEGIN_WRITE: &'static str = "BEGIN";
    const BEGIN_SNAPSHOT: &'static str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";
    const ONE_STATEMENT_APPEND: bool = true;
    const PAGE_BACK: &'static str = PAGE_BACK;
    const PAGE_FORWARD: &'static str = PAGE_FORWARD;
    const PAGE_BYTES_IN_SQL: bool = true;
    const NOW_MICROS: &'static str = "SELECT (extract(epoch FROM now()) * 1000000)::bigint";
    const LOCK_USER_ROW: &'static str =
        "SELECT version FROM chat_users WHERE tenant = $1 AND user_id = $2 FOR UPDATE";
    const EXPIRED_USERS: &'static str = r#"
SELECT user_id FROM chat_users
WHERE tenant = $1 AND user_id IN (
    SELECT user_id FROM chat_users
    WHERE tenant = $1 AND oldest_at < $2
    ORDER BY oldest_at LIMIT $3)
ORDER BY user_id
FOR UPDATE
"#;
    const DELETE_EXPIRED: &'static str = r#"
DELETE FROM chat_messages m USING (
    SELECT user_id, seq FROM chat_messages
    WHERE tenant = $1 AND user_id = ANY($2) AND created_at < $3
    LIMIT $4) v
WHERE m.tenant = $1 AND m.user_id = v.user_id AND m.seq = v.seq
RETURNING m.user_id
"#;
    const SUBTRACT_DELETED: &'static str = r#"
UPDATE chat_users u SET message_count = u.message_count - g.n, version = u.version + 1,
    transcript_digest = NULL
FROM (SELECT user_id, count(*) AS n FROM unnest($2::text[]) AS gone(user_id) GROUP BY user_id) g
WHERE u.tenant = $1 AND u.user_id = g.user_id
"#;
    const REFRESH_OLDEST: &'static str = r#"
UPDATE chat_users u SET oldest_at = (
    SELECT created_at FROM chat_messages m
    WHERE m.tenant = u.tenant AND m.user_id = u.user_id ORDER BY seq LIMIT 1)
WHERE u.tenant = $1 AND u.user_id = ANY($2)
"#;

    type Names = Vec<String>;

    fn names(users: &[String]) -> Vec<String> {
        users.to_vec()
    }

    fn rows_affected(result: &PgQueryResult) -> u64 {
        result.rows_affected()
    }

    fn migrator() -> &'static Migrator {
        &MIGRATOR
    }

    async fn migrate(pool: &Pool<Postgres>, prepared: bool) -> Result<(), StoreError> {
        // When the pool gives up waiting for a connection, a direct attempt
        // finds out why (refused, unknown host, TLS, authentication): the
        // pool's own error says only that it timed out.
        let mut conn = match pool.acquire().await {
            Err(sqlx::Error::PoolTimedOut) => {
                let cause = PgConnection::connect_with(&pool.connect_options())
                    .await
                    .err()
                    .unwrap_or(sqlx::Error::PoolTimedOut);
                return Err(cause.into());
            }
            acquired => acquired?,
        };
        if prepared {
            MIGRATOR.run_direct(&mut *conn).await?;
            return Ok(());
        }
        // Behind a transaction-mode pooler: the migrator's session lock and
        // named statements must not outlive our hold on the server
        // connection, so it runs inside one transaction, which drops every
        // prepared statement before it commits.
        let mut tx = conn.begin().await?;
        MIGRATOR.run_direct(&mut *tx).await?;
        sqlx::query("DEALLOCATE ALL")
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        conn.close().await?;
        Ok(())
    }

    async fn append(
        conn: &mut PgConnection,
        prepared: bool,
        tenant: &Tenant,
        user: &UserId,
        messages: &[NewMessage],
        now: Timestamp,
    ) -> Result<Counters, StoreError> {
        let (bodies, digests) = columns(messages);
        Ok(sqlx::query_as(APPEND)
            .persistent(prepared)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(db_count(messages.len()))
            .bind(now)
            .bind(bodies)
            .bind(digests)
            .fetch_one(conn)
            .await?)
    }

    async fn insert_records(
        conn: &mut PgConnection,
        prepared: bool,
        tenant: &Tenant,
        user: &str,
        rows: &[MessageRecord],
    ) -> Result<(), StoreError> {
        let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        let times: Vec<DateTime<Utc>> = rows.iter().map(|r| r.created_at.to_datetime()).collect();
        let bodies: Vec<&str> = rows.iter().map(|r| r.message.as_str()).collect();
        let digests: Vec<&[u8]> = rows.iter().map(|r| r.digest.as_slice()).collect();
        sqlx::query(INSERT_RECORDS)
            .persistent(prepared)
            .bind(tenant.as_str())
            .bind(user)
            .bind(seqs)
            .bind(times)
            .bind(bodies)
            .bind(digests)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn insert_messages(
        conn: &mut PgConnection,
        prepared: bool,
        tenant: &Tenant,
        user: &UserId,
        first_seq: i64,
        created_at: Timestamp,
        messages: &[NewMessage],
    ) -> Result<(), StoreError> {
        let (bodies, digests) = columns(messages);
        sqlx::query(INSERT_MESSAGES)
            .persistent(prepared)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(first_seq)
            .bind(created_at)
            .bind(bodies)
            .bind(digests)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn append_many(
        conn: &mut PgConnection,
        prepared: bool,
        appends: &[&Append],
    ) -> Result<Vec<Counters>, StoreError> {
        let fold = Fold::new(appends);
        let rows: Vec<SlotFinal> = sqlx::query_as(APPEND_MANY)
            .persistent(prepared)
            .bind(column(&fold.users, |u| u.tenant))
            .bind(column(&fold.users, |u| u.user))
            .bind(column(&fold.users, |u| u.messages))
            .bind(column(&fold.users, |u| u.appends))
            .bind(column(&fold.users, |u| u.at.to_datetime()))
            .bind(column(&fold.messages, |m| slot_number(m.slot)))
            .bind(column(&fold.messages, |m| m.place))
            .bind(column(&fold.messages, |m| m.message.body()))
            .bind(column(&fold.messages, |m| m.message.digest().to_vec()))
            .fetch_all(conn)
            .await?;
        let mut finals: Vec<Option<Final>> = vec![None; fold.users.len()];
        for row in rows {
            let slot = usize::try_from(row.slot - 1)
                .ok()
                .and_then(|slot| finals.get_mut(slot))
                .ok_or_else(|| StoreError::Corrupt(format!("slot {}", row.slot)))?;
            *slot = Some(row.after);
        }
        fold.counters(&finals)
    }

    const SHARED_WRITER: bool = false;
    const READS_MANY: bool = true;

    async fn pages_back_many(
        conn: &mut PgConnection,
        prepared: bool,
        reads: &[PageBack],
        known: &[Option<Mark>],
        page_bytes: usize,
    ) -> Result<Vec<CheckedPage>, StoreError> {
        use futures_util::TryStreamExt;
        let page_budget = i64::try_from(page_bytes).unwrap_or(i64::MAX);
        let mut rows = match (reads, known) {
            // One read, as most are while few are in flight: the same
            // statement for one user, with no arrays to build and unnest
            // (that took Postgres a third of the statement's time).
            ([read], [mark]) => sqlx::query_as::<_, CheckedRow>(PAGE_BACK_CHECKED)
                .persistent(prepared)
                .bind(read.tenant.as_str())
                .bind(read.user.as_str())
                .bind(read.below)
                .bind(read.fetch)
                .bind(mark.map(|k| k.version))
                .bind(mark.map(|k| k.newest_at.to_datetime()))
                .bind(mark.map(|k| k.server_started_at.to_datetime()))
                .bind(page_budget)
                .fetch(conn),
            _ => sqlx::query_as::<_, CheckedRow>(PAGES_BACK)
                .persistent(prepared)
                .bind(column(reads, |r| r.tenant.as_str()))
                .bind(column(reads, |r| r.user.as_str()))
                .bind(column(reads, |r| r.below))
                .bind(column(reads, |r| r.fetch))
                .bind(column(known, |k| k.map(|k| k.version)))
                .bind(column(known, |k| k.map(|k| k.newest_at.to_datetime())))
                .bind(column(known, |k| {
                    k.map(|k| k.server_started_at.to_datetime())
                }))
                .bind(page_budget)
                .fetch(conn),
        };
        let mut pages: Vec<Gathered> = reads.iter().map(|_| Gathered::default()).collect();
        let mut budget = BatchBytes {
            page: page_bytes,
            batch: page_bytes.saturating_mul(BATCH_PAGE_BUDGETS),
            kept: 0,
        };
        while let Some(row) = rows.try_next().await? {
            let slot = usize::try_from(row.slot - 1)
                .ok()
                .and_then(|slot| Some((slot, pages.get_mut(slot)?)));
            let Some((slot, page)) = slot else {
                return Err(StoreError::Corrupt(format!("slot {}", row.slot)));
            };
            page.mark = row
                .version
                .zip(row.newest_at)
                .map(|(version, newest_at)| Mark {
                    version,
                    newest_at,
                    server_started_at: row.server_started_at,
                });
            match (row.seq, row.created_at, row.message) {
                (Some(seq), Some(at), Some(text)) => {
                    page.offer((seq, at, body(text)?), &mut budget);
                }
                // No message: the user has none below the read's `seq`,
                // or its mark is still the one the read came with.
                _ if page.mark.is_some() && page.mark == known[slot] => page.unchanged = true,
                _ => {}
            }
        }
        Ok(pages.into_iter().map(Gathered::finish).collect())
    }

    async fn lock_users(
        conn: &mut PgConnection,
        prepared: bool,
        users: &[(&str, &str)],
        floor: Timestamp,
    ) -> Result<(), StoreError> {
        let (tenants, ids): (Vec<&str>, Vec<&str>) = users.iter().copied().unzip();
        sqlx::query(LOCK_USERS)
            .persistent(prepared)
            .bind(tenants)
            .bind(ids)
            .bind(floor)
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// A user's counters after a batch, as `APPEND_MANY` returns them.
#[derive(FromRow)]
struct SlotFinal {
    slot: i64,
    #[sqlx(flatten)]
    after: Final,
}

/// One array parameter of a statement that takes a batch as arrays: `of`
/// each item, in order.
fn column<'a, T, U>(items: &'a [T], of: impl Fn(&'a T) -> U) -> Vec<U> {
    items.iter().map(of).collect()
}

/// The bodies and digests of `messages`, as two parallel arrays.
fn columns(messages: &[NewMessage]) -> (Vec<&str>, Vec<Vec<u8>>) {
    messages
        .iter()
        .map(|m| (m.body(), m.digest().to_vec()))
        .unzip()
}

/// What an append does to a user that exists, in `APPEND` and
/// `APPEND_MANY`: the new values row (`EXCLUDED`) carries the messages and
/// appends added (`message_count`, `version`) and their time.
macro_rules! bump_counters {
    () => {
        r#"
    ON CONFLICT (tenant, user_id) DO UPDATE SET
        last_seq = u.last_seq + EXCLUDED.last_seq,
        version = u.version + EXCLUDED.version,
        message_count = u.message_count + EXCLUDED.message_count,
        transcript_digest = NULL,
        last_created_at = GREATEST(u.last_created_at, EXCLUDED.last_created_at),
        oldest_at = CASE WHEN u.message_count = 0
            THEN GREATEST(u.last_created_at, EXCLUDED.last_created_at)
            ELSE u.oldest_at END
"#
    };
}

/// One statement: upserts the user's counters (which locks its row) and
/// inserts the batch `$5`/`$6` after its last `seq`.
const APPEND: &str = concat!(
    r#"
WITH u AS (
    INSERT INTO chat_users AS u
        (tenant, user_id, last_seq, version, message_count, last_created_at, oldest_at)
    VALUES ($1, $2, $3, 1, $3, $4, $4)
"#,
    bump_counters!(),
    r#"    RETURNING u.last_seq, u.version, u.last_created_at, u.message_count, u.transcript_digest
), inserted AS (
    INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest)
    SELECT $1, $2, u.last_seq - $3 + m.ord, u.last_created_at, m.body, m.digest
    FROM u, unnest($5::text[], $6::bytea[]) WITH ORDINALITY AS m(body, digest, ord)
)
SELECT last_seq, version, last_created_at, message_count, transcript_digest FROM u
"#
);

/// `APPEND` for many users in one statement: `$1`..`$5` one entry per user
/// (tenant, user, its messages, its appends, its time), `$6`..`$9` one per
/// message (its user's slot in `$1`, from 1; its place among that user's
/// messages, from 1; body; digest). Users are locked in key order ("C", as
/// every key compares), so that two batches never wait for each other in a
/// cycle; each user's counters move once, by all its appends together.
const APPEND_MANY: &str = concat!(
    r#"
WITH batch AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::timestamptz[])
        WITH ORDINALITY AS b(tenant, user_id, n, appends, at, slot)
), u AS (
    INSERT INTO chat_users AS u
        (tenant, user_id, last_seq, version, message_count, last_created_at, oldest_at)
    SELECT tenant, user_id, n, appends, n, at, at FROM batch
    ORDER BY tenant COLLATE "C", user_id COLLATE "C"
"#,
    bump_counters!(),
    r#"    RETURNING u.tenant, u.user_id, u.last_seq, u.version, u.last_created_at, u.message_count
), placed AS (
    SELECT b.slot, b.n, u.* FROM batch b JOIN u ON u.tenant = b.tenant AND u.user_id = b.user_id
), inserted AS (
    INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest)
    SELECT p.tenant, p.user_id, p.last_seq - p.n + m.pos, p.last_created_at, m.body, m.digest
    FROM unnest($6::bigint[], $7::bigint[], $8::text[], $9::bytea[]) AS m(slot, pos, body, digest)
    JOIN placed p ON p.slot = m.slot
)
SELECT slot, last_seq, version, message_count, last_created_at FROM placed
"#
);

// Which rows of a page the server sends: each row while the bodies of the
// rows before it fit the page's byte budget, so the first row that does not
// fit comes too (for `has_more` and the age filter), and none after it.
// `octet_length` reads a stored body's length from its TOAST header: bodies
// left out are neither decompressed nor sent. The window runs over the
// rows the `LIMIT` takes, in index order: no sort.

/// One user's rows of a page, as a subquery `page` whose rows stop after
/// the first that does not fit the page's bytes: the rows `where` picks,
/// in `seq` order `order` (`"DESC"` or `"ASC"`), at most `limit` of them,
/// cut at `bytes`. Each argument is SQL text (a placeholder, a column); the
/// four statements below differ only in them, so the cut rule is written
/// once.
macro_rules! page_rows {
    (where: $where:expr, order: $order:expr, limit: $limit:expr, bytes: $bytes:expr) => {
        concat!(
            r#"SELECT seq, created_at, message FROM (
        SELECT seq, created_at, message,
            count(*) OVER ahead AS rows_ahead, sum(octet_length(message)) OVER ahead AS bytes_ahead
        FROM chat_messages
        WHERE "#,
            $where,
            r#"
        WINDOW ahead AS (ORDER BY seq "#,
            $order,
            r#" ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
        ORDER BY seq "#,
            $order,
            " LIMIT ",
            $limit,
            r#") page
    WHERE rows_ahead < 2 OR bytes_ahead <= "#,
            $bytes
        )
    };
}

/// `sql::PAGE_BACK`, sending no row past the page's bytes (`$5`).
const PAGE_BACK: &str = concat!(
    page_rows!(
        where: "tenant = $1 AND user_id = $2 AND seq < $3",
        order: "DESC",
        limit: "$4",
        bytes: "$5"
    ),
    "\nORDER BY seq DESC"
);

/// `sql::PAGE_FORWARD`, sending no row past the page's bytes (`$6`).
const PAGE_FORWARD: &str = concat!(
    page_rows!(
        where: "tenant = $1 AND user_id = $2 AND seq > $3 AND seq < $4",
        order: "ASC",
        limit: "$5",
        bytes: "$6"
    ),
    "\nORDER BY seq"
);

/// The mark check of `PAGES_BACK` and `PAGE_BACK_CHECKED`: a read whose
/// known mark (version, newest time, server start) is still the user's
/// (`u`) reads no messages.
macro_rules! unless_marked {
    ($version:expr, $at:expr, $start:expr) => {
        concat!(
            "(",
            $version,
            " IS NULL OR u.version IS DISTINCT FROM ",
            $version,
            "\n                 OR u.last_created_at IS DISTINCT FROM ",
            $at,
            "\n                 OR pg_postmaster_start_time() IS DISTINCT FROM ",
            $start,
            ")"
        )
    };
}

/// `PAGE_BACK` for many users: the newest `$4` messages below `$3` of each
/// user `$1`/`$2`, with the slot (from 1) of the read each row is for and
/// the user's mark (`version`, `last_created_at`, and when the server
/// started). A read whose mark `$5`/`$6`/`$7` is still the user's gets one
/// row with its mark and no message: its messages are not read. Each
/// user's rows are one index range, as `PAGE_BACK` reads them, and stop
/// after the first that does not fit the page's bytes `$8`. The rows
/// come in no promised order: `pages_back_many` puts them in theirs, which
/// costs it less than a sort on the server. The user's row is a lateral
/// lookup (its `LIMIT` keeps the planner from making it a join): as a join,
/// the one plan made for any batch hashed the batch and scanned all of
/// `chat_users` for it while the table was small (with 2,000 users, that
/// halved the reads a second at c=8, and the scan grew with every user).
const PAGES_BACK: &str = concat!(
    r#"
SELECT b.slot, u.version, u.last_created_at AS newest_at,
    pg_postmaster_start_time() AS server_started_at, m.seq, m.created_at, m.message
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[],
        $5::bigint[], $6::timestamptz[], $7::timestamptz[])
    WITH ORDINALITY AS b(tenant, user_id, below, n, known_version, known_at, known_start, slot)
LEFT JOIN LATERAL (
    SELECT version, last_created_at FROM chat_users
    WHERE tenant = b.tenant AND user_id = b.user_id LIMIT 1) u ON true
LEFT JOIN LATERAL (
    "#,
    page_rows!(
        where: concat!(
            "tenant = b.tenant AND user_id = b.user_id AND seq < b.below\n            AND ",
            unless_marked!("b.known_version", "b.known_at", "b.known_start")
        ),
        order: "DESC",
        limit: "b.n",
        bytes: "$8"
    ),
    ") m ON true\n"
);

/// `PAGES_BACK` for one read, with its values bound as they are: the user
/// `$1`/`$2`, `$4` messages below `$3`, the mark `$5`/`$6`/`$7` and the
/// page's bytes `$8`. Always one row at least (slot 1), as there.
const PAGE_BACK_CHECKED: &str = concat!(
    r#"
SELECT 1::bigint AS slot, u.version, u.last_created_at AS newest_at,
    pg_postmaster_start_time() AS server_started_at, m.seq, m.created_at, m.message
FROM (VALUES (1)) AS one(n)
LEFT JOIN LATERAL (
    SELECT version, last_created_at FROM chat_users
    WHERE tenant = $1 AND user_id = $2) u ON true
LEFT JOIN LATERAL (
    "#,
    page_rows!(
        where: concat!(
            "tenant = $1 AND user_id = $2 AND seq < $3\n            AND ",
            unless_marked!("$5::bigint", "$6::timestamptz", "$7::timestamptz")
        ),
        order: "DESC",
        limit: "$4",
        bytes: "$8"
    ),
    ") m ON true\n"
);

/// The bytes of bodies a batch of page reads keeps: each page's own budget,
/// and the batch's, of which `kept` is taken.
struct BatchBytes {
    page: usize,
    batch: usize,
    kept: usize,
}

/// One read's rows as `pages_back_many` gathers them, in whatever order
/// they come.
#[derive(Default)]
struct Gathered {
    mark: Option<Mark>,
    /// The mark was still the one the read came with: no rows were read.
    unchanged: bool,
    rows: Vec<PageRow>,
    bytes: usize,
    /// The newest row left out, `seq` and `created_at`: the page holds
    /// only the rows newer than it.
    left_out: Option<(i64, Timestamp)>,
    /// Its rows did not fit the batch's bytes: to be read alone.
    unread: bool,
}

impl Gathered {
    fn offer(&mut self, (seq, at, body): PageRow, budget: &mut BatchBytes) {
        let newest_left_out = self.left_out.map_or(i64::MIN, |(s, _)| s);
        if self.unread || seq < newest_left_out {
            return;
        }
        let len = body.get().len();
        if !self.rows.is_empty() && self.bytes.saturating_add(len) > budget.page {
            self.left_out = Some((seq, at));
        } else if budget.kept > 0 && budget.kept.saturating_add(len) > budget.batch {
            budget.kept -= self.bytes;
            self.rows = Vec::new();
            self.bytes = 0;
            self.unread = true;
            self.left_out = Some((seq, at));
        } else {
            self.bytes += len;
            budget.kept += len;
            self.rows.push((seq, at, body));
        }
    }

    fn finish(self) -> CheckedPage {
        let rows = if self.unchanged {
            None
        } else {
            let mut rows = self.rows;
            // Newest first; as the server read them, this only checks.
            rows.sort_unstable_by_key(|&(seq, _, _)| std::cmp::Reverse(seq));
            if let Some((seq, _)) = self.left_out {
                rows.retain(|&(s, _, _)| s > seq);
            }
            Some(Page {
                rows,
                cut: self.left_out.map(|(_, at)| at),
            })
        };
        CheckedPage {
            mark: self.mark,
            rows,
        }
    }
}

/// A row of `PAGES_BACK`.
#[derive(FromRow)]
struct CheckedRow {
    slot: i64,
    version: Option<i64>,
    newest_at: Option<Timestamp>,
    server_started_at: Timestamp,
    seq: Option<i64>,
    created_at: Option<Timestamp>,
    message: Option<String>,
}

/// `LOCK_USER` for the users `$1`/`$2`, in key order, creating missing
/// ones with no messages at `$3`.
const LOCK_USERS: &str = r#"
INSERT INTO chat_users (tenant, user_id, last_seq, version, message_count, last_created_at)
SELECT tenant, user_id, 0, 0, 0, $3 FROM unnest($1::text[], $2::text[]) AS b(tenant, user_id)
ORDER BY tenant COLLATE "C", user_id COLLATE "C"
ON CONFLICT (tenant, user_id) DO UPDATE SET version = chat_users.version
"#;

const INSERT_RECORDS: &str = r#"
INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest)
SELECT $1, $2, m.seq, m.created_at, m.body, m.digest
FROM unnest($3::bigint[], $4::timestamptz[], $5::text[], $6::bytea[]) AS m(seq, created_at, body, digest)
"#;

const INSERT_MESSAGES: &str = r#"
INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest)
SELECT $1, $2, $3 + m.ord - 1, $4, m.body, m.digest
FROM unnest($5::text[], $6::bytea[]) WITH ORDINALITY AS m(body, digest, ord)
"#;

/// Times are `timestamptz`, which keeps whole microseconds like `Timestamp`.
impl Type<Postgres> for Timestamp {
    fn type_info() -> PgTypeInfo {
        <DateTime<Utc> as Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <DateTime<Utc> as Type<Postgres>>::compatible(ty)
    }
}

impl Encode<'_, Postgres> for Timestamp {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        <DateTime<Utc> as Encode<Postgres>>::encode_by_ref(&self.to_datetime(), buf)
    }
}

impl<'r> Decode<'r, Postgres> for Timestamp {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        Ok(Timestamp::from_datetime(<DateTime<Utc> as Decode<
            Postgres,
        >>::decode(value)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row whose body is `len` bytes of JSON (a string; 2 at least).
    fn row(seq: i64, len: usize) -> PageRow {
        let text = format!("\"{}\"", "x".repeat(len.saturating_sub(2)));
        (seq, Timestamp::from_micros(seq), body(text).unwrap())
    }

    fn budget(page: usize, batch: usize) -> BatchBytes {
        BatchBytes {
            page,
            batch,
            kept: 0,
        }
    }

    fn seqs(page: &CheckedPage) -> (Vec<i64>, Option<Timestamp>) {
        let page = page.rows.as_ref().unwrap();
        (page.rows.iter().map(|r| r.0).collect(), page.cut)
    }

    #[test]
    fn a_page_keeps_the_newest_rows_that_fit_whatever_order_they_come_in() {
        let mut bytes = budget(350, 10_000);
        let mut page = Gathered::default();
        for (seq, len) in [(8, 100), (10, 100), (7, 200), (9, 100), (6, 10)] {
            page.offer(row(seq, len), &mut bytes);
        }
        // 8 and 10 fit, 7 would not (400 bytes) and is left out, 9 still
        // fits, 6 is below a row left out and skipped.
        assert_eq!(
            seqs(&page.finish()),
            (vec![10, 9, 8], Some(Timestamp::from_micros(7)))
        );
        let mut page = Gathered::default();
        page.offer(row(5, 1000), &mut budget(250, 10_000));
        assert_eq!(seqs(&page.finish()), (vec![5], None), "one row always fits");
    }

    #[test]
    fn a_read_past_the_batch_bytes_is_given_back_unread() {
        let mut bytes = budget(250, 300);
        let (mut a, mut b) = (Gathered::default(), Gathered::default());
        a.offer(row(2, 100), &mut bytes);
        a.offer(row(1, 100), &mut bytes);
        b.offer(row(9, 50), &mut bytes);
        b.offer(row(8, 100), &mut bytes);
        assert_eq!(bytes.kept, 200, "b's rows are dropped with it");
        assert_eq!(seqs(&a.finish()), (vec![2, 1], None));
        let b = b.finish();
        assert!(b.rows.as_ref().unwrap().unread());
    }
}
