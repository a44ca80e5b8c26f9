//! The embedded default's dialect: what SQLite says differently from the
//! shared SQL in `sql.rs`. SQLite has one writer at a time, so writes go
//! through a pool of exactly one connection that takes the write lock at
//! `BEGIN IMMEDIATE` (no lock upgrades, no `SQLITE_BUSY` between our own
//! writers; that transaction is what Postgres's row locks are), while reads
//! use a pool of read-only connections that WAL lets run beside it.
//! `synchronous = FULL`: an acknowledged append survives a power cut, not
//! only a crash. Lists of users bind as JSON arrays (SQLite has no array
//! binds), and times are integer microseconds.

use std::str::FromStr;

use async_trait::async_trait;
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    SqliteArgumentValue, SqliteConnectOptions, SqliteConnection, SqliteJournalMode,
    SqliteQueryResult, SqliteSynchronous, SqliteTypeInfo, SqliteValueRef,
};
use sqlx::{Decode, Encode, Pool, Sqlite, Type};

use super::batch::{Append, PageBack};
use super::fold::{Final, Fold};
use super::recent::Mark;
use super::sql::{CheckedPage, Counters, Dialect, SqlStore};
use super::{db_count, pool_options, ConnectOptions, MessageRecord, StoreError};
use crate::domain::{NewMessage, Tenant, Timestamp, UserId};

pub type SqliteStore = SqlStore<Sqlite>;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// Rows per INSERT statement: 3 bound values each, well under SQLite's
/// limit of 32,766 bound values per statement.
const INSERT_CHUNK: usize = 500;

/// How much of the database file each connection maps: the first 256 MiB,
/// as address space, not memory (the pages are the OS's file cache).
const MMAP_BYTES: u64 = 256 << 20;

pub async fn connect(url: &str, options: ConnectOptions) -> Result<SqliteStore, StoreError> {
    let connect = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(options.acquire_timeout)
        .foreign_keys(true)
        // Pages of the database file read from a map of it rather than
        // copied in by a system call each (the WAL is read as ever, and
        // nothing is written through the map): 1.08-1.11× the reads alone.
        .pragma("mmap_size", MMAP_BYTES.to_string());
    let readers = pool_options::<Sqlite>(options.max_connections, &options)
        .connect_lazy_with(connect.clone().read_only(true));
    // The writer's temporary storage in memory: a statement that writes
    // many rows in a transaction (a shared commit's upsert of its users)
    // keeps a journal to undo itself, which past 64 KiB SQLite otherwise
    // spills to a temporary file, created, written and deleted per commit.
    // It holds a copy of each page one statement changes: an upsert of at
    // most `UPSERT_CHUNK` users changes a few hundred at most.
    let writer_options = connect.pragma("temp_store", "memory");
    // At once, so that the file exists (and a bad path fails) at start-up.
    let writer = pool_options::<Sqlite>(1, &options)
        .connect_with(writer_options)
        .await?;
    Ok(SqlStore::new(writer, Some(readers), true, &options)
        .with_batching(options.commit_batch, None))
}

#[async_trait]
impl Dialect for Sqlite {
    const BEGIN_WRITE: &'static str = "BEGIN IMMEDIATE";
    const BEGIN_SNAPSHOT: &'static str = "BEGIN";
    const ONE_STATEMENT_APPEND: bool = false;
    const PAGE_BACK: &'static str = super::sql::PAGE_BACK;
    const PAGE_FORWARD: &'static str = super::sql::PAGE_FORWARD;
    const PAGE_BYTES_IN_SQL: bool = false;
    const NOW_MICROS: &'static str =
        "SELECT CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)";
    const LOCK_USER_ROW: &'static str =
        "SELECT version FROM chat_users WHERE tenant = $1 AND user_id = $2";
    const EXPIRED_USERS: &'static str = "SELECT user_id FROM chat_users
        WHERE tenant = $1 AND oldest_at < $2 ORDER BY oldest_at LIMIT $3";
    const DELETE_EXPIRED: &'static str = r#"
DELETE FROM chat_messages WHERE rowid IN (
    SELECT rowid FROM chat_messages
    WHERE tenant = $1 AND user_id IN (SELECT value FROM json_each($2)) AND created_at < $3
    LIMIT $4)
RETURNING user_id
"#;
    const SUBTRACT_DELETED: &'static str = r#"
UPDATE chat_users SET message_count = message_count - g.n, version = version + 1,
    transcript_digest = NULL
FROM (SELECT value AS user_id, count(*) AS n FROM json_each($2) GROUP BY value) AS g
WHERE chat_users.tenant = $1 AND chat_users.user_id = g.user_id
"#;
    const REFRESH_OLDEST: &'static str = r#"
UPDATE chat_users SET oldest_at = (
    SELECT created_at FROM chat_messages m
    WHERE m.tenant = chat_users.tenant AND m.user_id = chat_users.user_id
    ORDER BY seq LIMIT 1)
WHERE tenant = $1 AND user_id IN (SELECT value FROM json_each($2))
"#;

    type Names = String;

    fn names(users: &[String]) -> String {
        serde_json::to_string(users).unwrap_or_else(|_| "[]".into())
    }

    fn rows_affected(result: &SqliteQueryResult) -> u64 {
        result.rows_affected()
    }

    fn migrator() -> &'static Migrator {
        &MIGRATOR
    }

    async fn migrate(pool: &Pool<Sqlite>, _prepared: bool) -> Result<(), StoreError> {
        MIGRATOR.run(pool).await?;
        Ok(())
    }

    async fn append(
        conn: &mut SqliteConnection,
        prepared: bool,
        tenant: &Tenant,
        user: &UserId,
        messages: &[NewMessage],
        now: Timestamp,
    ) -> Result<Counters, StoreError> {
        let counters: Counters = sqlx::query_as(UPSERT_USER)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(db_count(messages.len()))
            .bind(now)
            .fetch_one(&mut *conn)
            .await?;
        let first_seq = counters.last_seq - db_count(messages.len()) + 1;
        let at = counters.last_created_at;
        Self::insert_messages(conn, prepared, tenant, user, first_seq, at, messages).await?;
        Ok(counters)
    }

    const SHARED_WRITER: bool = true;

    /// The users' counters in one upsert per 100 users and the messages in
    /// one insert per 500: the single writer runs a handful of statements
    /// per batch rather than two per append.
    async fn append_many(
        conn: &mut SqliteConnection,
        _prepared: bool,
        appends: &[&Append],
    ) -> Result<Vec<Counters>, StoreError> {
        let fold = Fold::new(appends);
        let mut finals: Vec<Option<Final>> = vec![None; fold.users.len()];
        for users in fold.users.chunks(UPSERT_CHUNK) {
            let sql = upsert_users_sql(users.len());
            let mut upsert = sqlx::query_as::<_, (String, String, i64, i64, i64, Timestamp)>(&sql);
            for user in users {
                upsert = upsert
                    .bind(user.tenant)
                    .bind(user.user)
                    .bind(user.messages)
                    .bind(user.appends)
                    .bind(user.messages)
                    .bind(user.at)
                    .bind(user.at);
            }
            for (tenant, user, last_seq, version, message_count, last_created_at) in
                upsert.fetch_all(&mut *conn).await?
            {
                let slot = fold
                    .slot(&tenant, &user)
                    .and_then(|slot| finals.get_mut(slot))
                    .ok_or_else(|| StoreError::Corrupt("an upsert of another user".into()))?;
                *slot = Some(Final {
                    last_seq,
                    version,
                    message_count,
                    last_created_at,
                });
            }
        }
        let firsts = fold.first_seqs(&finals);
        for rows in fold.messages.chunks(INSERT_CHUNK) {
            let sql = insert_sql(rows.len(), 1, 6, |_| "(?, ?, ?, ?, ?, ?)".into());
            let mut insert = sqlx::query(&sql);
            for row in rows {
                let user = &fold.users[row.slot];
                let at = finals[row.slot]
                    .as_ref()
                    .map_or(user.at, |after| after.last_created_at);
                insert = insert
                    .bind(user.tenant)
                    .bind(user.user)
                    .bind(firsts[row.slot] + row.place - 1)
                    .bind(at)
                    .bind(row.message.body())
                    .bind(row.message.digest().to_vec());
            }
            insert.execute(&mut *conn).await?;
        }
        fold.counters(&finals)
    }

    /// Reads run beside each other on the read-only connections, each in
    /// sqlx's worker thread of its own: batching them would serialize them.
    const READS_MANY: bool = false;

    async fn pages_back_many(
        _conn: &mut SqliteConnection,
        _prepared: bool,
        _reads: &[PageBack],
        _known: &[Option<Mark>],
        _page_bytes: usize,
    ) -> Result<Vec<CheckedPage>, StoreError> {
        Err(StoreError::Corrupt(
            "SQLite reads pages one statement each (READS_MANY is false)".into(),
        ))
    }

    async fn insert_records(
        conn: &mut SqliteConnection,
        _prepared: bool,
        tenant: &Tenant,
        user: &str,
        rows: &[MessageRecord],
    ) -> Result<(), StoreError> {
        for chunk in rows.chunks(INSERT_CHUNK) {
            let sql = insert_sql(chunk.len(), 3, 4, |p| {
                format!("($1, $2, ${p}, ${}, ${}, ${})", p + 1, p + 2, p + 3)
            });
            let mut insert = sqlx::query(&sql).bind(tenant.as_str()).bind(user);
            for row in chunk {
                insert = insert
                    .bind(row.seq)
                    .bind(row.created_at)
                    .bind(row.message.as_str())
                    .bind(row.digest.as_slice());
            }
            insert.execute(&mut *conn).await?;
        }
        Ok(())
    }

    async fn insert_messages(
        conn: &mut SqliteConnection,
        _prepared: bool,
        tenant: &Tenant,
        user: &UserId,
        first_seq: i64,
        created_at: Timestamp,
        messages: &[NewMessage],
    ) -> Result<(), StoreError> {
        for (chunk_index, chunk) in messages.chunks(INSERT_CHUNK).enumerate() {
            let sql = insert_sql(chunk.len(), 4, 3, |p| {
                format!("($1, $2, ${p}, $3, ${}, ${})", p + 1, p + 2)
            });
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
            insert.execute(&mut *conn).await?;
        }
        Ok(())
    }
}

/// The head of an upsert of users' counters; one row of values per user
/// follows.
macro_rules! upsert_users_head {
    () => {
        "INSERT INTO chat_users \
         (tenant, user_id, last_seq, version, message_count, last_created_at, oldest_at) VALUES "
    };
}

/// What an append does to a user that exists: its values row carries the
/// messages and appends added (`message_count`, `version`) and their time.
macro_rules! upsert_users_bump {
    () => {
        " ON CONFLICT (tenant, user_id) DO UPDATE SET
            last_seq = last_seq + excluded.last_seq,
            version = version + excluded.version,
            message_count = message_count + excluded.message_count,
            transcript_digest = NULL,
            last_created_at = max(last_created_at, excluded.last_created_at),
            oldest_at = CASE WHEN message_count = 0
                THEN max(last_created_at, excluded.last_created_at)
                ELSE oldest_at END"
    };
}

/// Postgres's append CTE has no SQLite twin (a CTE cannot write there), so
/// the counters are bumped first and the rows inserted after.
const UPSERT_USER: &str = concat!(
    upsert_users_head!(),
    "($1, $2, $3, 1, $3, $4, $4)",
    upsert_users_bump!(),
    " RETURNING last_seq, version, last_created_at, message_count, transcript_digest"
);

/// Users per multi-row upsert: 7 bound values each.
const UPSERT_CHUNK: usize = 100;

/// `UPSERT_USER` for `users` users at once: per user, its tenant, user,
/// messages, appends, messages again, time and time again; it returns each
/// user's counters with its key. Parameters are bare `?`s, bound in order:
/// sqlx looks each named one (`$n`) up by name, and SQLite finds a name by
/// walking the statement's list of them, so a batch of n named parameters
/// cost O(n²) (3 % of the service's CPU under appends at c=64).
fn upsert_users_sql(users: usize) -> String {
    let mut sql = String::from(upsert_users_head!());
    for i in 0..users {
        if i > 0 {
            sql.push(',');
        }
        sql.push_str("(?, ?, ?, ?, ?, ?, ?)");
    }
    sql.push_str(concat!(
        upsert_users_bump!(),
        " RETURNING tenant, user_id, last_seq, version, message_count, last_created_at"
    ));
    sql
}

/// `INSERT … VALUES` for `rows` messages: `row(p)` is the tuple of one
/// row, whose `per_row` parameters start at $p; the first row's start at
/// $`first` (those before it are shared by every row: tenant, user).
///
/// `OR FAIL`: every insert runs in a write transaction that is rolled back
/// whole when a statement fails, so a failing statement need not undo its
/// own earlier rows. With SQLite's default (`ABORT`) a statement of many
/// rows inside a transaction keeps a statement journal to undo them: a
/// copy of every page it changes (see `connect` for where that goes).
fn insert_sql(rows: usize, first: usize, per_row: usize, row: impl Fn(usize) -> String) -> String {
    let mut sql = String::from(
        "INSERT OR FAIL INTO chat_messages \
         (tenant, user_id, seq, created_at, message, digest) VALUES ",
    );
    for i in 0..rows {
        if i > 0 {
            sql.push(',');
        }
        sql.push_str(&row(first + per_row * i));
    }
    sql
}

/// Times are integer microseconds since the Unix epoch, UTC.
impl Type<Sqlite> for Timestamp {
    fn type_info() -> SqliteTypeInfo {
        <i64 as Type<Sqlite>>::type_info()
    }

    fn compatible(ty: &SqliteTypeInfo) -> bool {
        <i64 as Type<Sqlite>>::compatible(ty)
    }
}

impl<'q> Encode<'q, Sqlite> for Timestamp {
    fn encode_by_ref(&self, buf: &mut Vec<SqliteArgumentValue<'q>>) -> Result<IsNull, BoxDynError> {
        <i64 as Encode<Sqlite>>::encode_by_ref(&self.as_micros(), buf)
    }
}

impl<'r> Decode<'r, Sqlite> for Timestamp {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        Ok(Timestamp::from_micros(<i64 as Decode<Sqlite>>::decode(
            value,
        )?))
    }
}
