//! The embedded default. SQLite has one writer at a time, so writes go
//! through a pool of exactly one connection (no lock upgrades, no
//! `SQLITE_BUSY` between our own writers) while reads use a pool of
//! read-only connections that WAL lets run beside it. `synchronous = FULL`:
//! an acknowledged append survives a power cut, not only a crash.

use std::str::FromStr;

use async_trait::async_trait;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::Row;

use super::{assemble_page, latest_version, ConnectOptions, Store, StoreError};
use crate::domain::{
    Appended, HistoryPage, HistoryQuery, NewMessage, StoredMessage, Tenant, Timestamp, UserId,
    UserStats, UserSummary,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// Rows per INSERT statement: 3 bound values each, well under SQLite's
/// limit of 32,766 bound values per statement.
const INSERT_CHUNK: usize = 500;

pub struct SqliteStore {
    writer: SqlitePool,
    reader: SqlitePool,
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
        Ok(Self { writer, reader })
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
    last_created_at = max(last_created_at, excluded.last_created_at),
    oldest_at = CASE WHEN message_count = 0
        THEN max(last_created_at, excluded.last_created_at)
        ELSE oldest_at END
RETURNING last_seq, version, last_created_at, message_count
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
/// ?3 created_at, then seq and message for each row.
fn insert_messages_sql(rows: usize) -> String {
    let mut sql = String::from(
        "INSERT INTO chat_messages (tenant, user_id, seq, created_at, message) VALUES ",
    );
    for i in 0..rows {
        let p = 4 + 2 * i;
        if i > 0 {
            sql.push(',');
        }
        sql.push_str(&format!("(?1, ?2, ?{p}, ?3, ?{})", p + 1));
    }
    sql
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
    ) -> Result<Appended, StoreError> {
        let count = messages.len() as i64;
        let mut tx = self.writer.begin().await?;
        let row = sqlx::query(UPSERT_USER)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(count)
            .bind(now.as_micros())
            .fetch_one(&mut *tx)
            .await?;
        let last_seq: i64 = row.get("last_seq");
        let created_at: i64 = row.get("last_created_at");
        let first_seq = last_seq - count + 1;
        for (chunk_index, chunk) in messages.chunks(INSERT_CHUNK).enumerate() {
            let sql = insert_messages_sql(chunk.len());
            let mut insert = sqlx::query(&sql)
                .bind(tenant.as_str())
                .bind(user.as_str())
                .bind(created_at);
            let chunk_first = first_seq + (chunk_index * INSERT_CHUNK) as i64;
            for (message, seq) in chunk.iter().zip(chunk_first..) {
                insert = insert.bind(seq).bind(message.body());
            }
            insert.execute(&mut *tx).await?;
        }
        if let Some(cap) = cap {
            let excess = row.get::<i64, _>("message_count") - cap as i64;
            if excess > 0 {
                let evicted = sqlx::query(EVICT_OLDEST)
                    .bind(tenant.as_str())
                    .bind(user.as_str())
                    .bind(excess)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                sqlx::query(
                    "UPDATE chat_users SET message_count = message_count - ?3
                     WHERE tenant = ?1 AND user_id = ?2",
                )
                .bind(tenant.as_str())
                .bind(user.as_str())
                .bind(evicted as i64)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        let messages = messages
            .iter()
            .zip(first_seq..)
            .map(|(m, seq)| {
                StoredMessage::new(seq, at(created_at), m.body().to_owned())
                    .map_err(|e| StoreError::Corrupt(e.to_string()))
            })
            .collect::<Result<_, _>>()?;
        Ok(Appended {
            messages,
            version: row.get("version"),
        })
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
            .map(|r| (r.get("seq"), at(r.get("created_at")), r.get("message")))
            .collect();
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
            StoredMessage::new(seq, at(r.get("created_at")), r.get("message"))
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
        let mut tx = self.writer.begin().await?;
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
            "UPDATE chat_users SET message_count = message_count - 1, version = version + 1
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
        Ok(row.map(|r| UserStats {
            message_count: r.get("message_count"),
            first_seq: r.get("first_seq"),
            last_seq: r.get("last_seq"),
            oldest_at: at(r.get("oldest_at")),
            newest_at: at(r.get("newest_at")),
            version: r.get("version"),
        }))
    }

    async fn clear_user(&self, tenant: &Tenant, user: &UserId) -> Result<u64, StoreError> {
        let mut tx = self.writer.begin().await?;
        let deleted = sqlx::query("DELETE FROM chat_messages WHERE tenant = ?1 AND user_id = ?2")
            .bind(tenant.as_str())
            .bind(user.as_str())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if deleted == 0 {
            return Ok(0);
        }
        sqlx::query(
            "UPDATE chat_users SET version = version + 1, message_count = 0, oldest_at = NULL
             WHERE tenant = ?1 AND user_id = ?2",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(deleted)
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
        let has_more = rows.len() > limit as usize;
        let users = rows
            .into_iter()
            .take(limit as usize)
            .map(|r| {
                let user_id = UserId::parse(r.get::<String, _>("user_id"))
                    .map_err(|e| StoreError::Corrupt(e.0))?;
                Ok(UserSummary {
                    user_id,
                    message_count: r.get("message_count"),
                    newest_at: at(r.get("newest_at")),
                })
            })
            .collect::<Result<_, StoreError>>()?;
        Ok((users, has_more))
    }

    async fn close(&self) {
        self.writer.close().await;
        self.reader.close().await;
    }
}
