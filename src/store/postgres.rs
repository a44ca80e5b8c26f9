//! The production store. An append is one statement (a CTE that bumps the
//! user's counters and inserts the batch), which locks the user's row first;
//! every other write to a user takes that lock as its first statement.

use std::str::FromStr;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::Row;

use super::{assemble_page, latest_version, ConnectOptions, Store, StoreError};
use crate::domain::{
    Appended, HistoryPage, HistoryQuery, NewMessage, StoredMessage, Tenant, Timestamp, UserId,
    UserStats, UserSummary,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    pub fn connect(url: &str, options: ConnectOptions) -> Result<Self, StoreError> {
        let connect = PgConnectOptions::from_str(url)?.application_name("chat-history");
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            .connect_lazy_with(connect);
        Ok(Self { pool })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
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
        last_created_at = GREATEST(u.last_created_at, EXCLUDED.last_created_at),
        oldest_at = CASE WHEN u.message_count = 0
            THEN GREATEST(u.last_created_at, EXCLUDED.last_created_at)
            ELSE u.oldest_at END
    RETURNING u.last_seq, u.version, u.last_created_at, u.message_count
), inserted AS (
    INSERT INTO chat_messages (tenant, user_id, seq, created_at, message)
    SELECT $1, $2, u.last_seq - $3 + m.ord, u.last_created_at, m.body
    FROM u, unnest($5::text[]) WITH ORDINALITY AS m(body, ord)
)
SELECT last_seq, version, last_created_at, message_count FROM u
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
UPDATE chat_users SET message_count = message_count - (SELECT count(*) FROM gone)
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
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    async fn ready(&self) -> Result<(), StoreError> {
        let applied: Option<i64> =
            sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
                .fetch_one(&self.pool)
                .await
                .or_else(|e| match e {
                    // No migrations table yet: reachable, but not migrated.
                    sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => Ok(None),
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
        let bodies: Vec<&str> = messages.iter().map(NewMessage::body).collect();
        let append = sqlx::query(APPEND)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .bind(count)
            .bind(now.to_datetime())
            .bind(&bodies);
        let row = match cap {
            None => append.fetch_one(&self.pool).await?,
            Some(cap) => {
                let mut tx = self.pool.begin().await?;
                let row = append.fetch_one(&mut *tx).await?;
                let excess = row.get::<i64, _>("message_count") - cap as i64;
                if excess > 0 {
                    sqlx::query(EVICT_OLDEST)
                        .bind(tenant.as_str())
                        .bind(user.as_str())
                        .bind(excess)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                row
            }
        };
        let last_seq: i64 = row.get("last_seq");
        let created_at = at(row.get("last_created_at"));
        let first_seq = last_seq - count + 1;
        let messages = messages
            .iter()
            .zip(first_seq..)
            .map(|(m, seq)| {
                StoredMessage::new(seq, created_at, m.body().to_owned())
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
                    .fetch_all(&self.pool)
                    .await?
            }
            Some(after) => {
                let not_before = query.not_before.unwrap_or(Timestamp::from_micros(0));
                sqlx::query(PAGE_FORWARD)
                    .bind(tenant.as_str())
                    .bind(user.as_str())
                    .bind(after)
                    .bind(before)
                    .bind(not_before.to_datetime())
                    .bind(fetch)
                    .fetch_all(&self.pool)
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
             WHERE tenant = $1 AND user_id = $2 AND seq = $3",
        )
        .bind(tenant.as_str())
        .bind(user.as_str())
        .bind(seq)
        .fetch_optional(&self.pool)
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
        let mut tx = self.pool.begin().await?;
        let locked =
            sqlx::query("SELECT 1 FROM chat_users WHERE tenant = $1 AND user_id = $2 FOR UPDATE")
                .bind(tenant.as_str())
                .bind(user.as_str())
                .fetch_optional(&mut *tx)
                .await?;
        if locked.is_none() {
            return Ok(false);
        }
        let deleted = sqlx::query(
            "WITH gone AS (
                DELETE FROM chat_messages WHERE tenant = $1 AND user_id = $2 AND seq = $3
                RETURNING 1)
             UPDATE chat_users SET message_count = message_count - 1, version = version + 1
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
        let row = sqlx::query(STATS)
            .bind(tenant.as_str())
            .bind(user.as_str())
            .fetch_optional(&self.pool)
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
        let mut tx = self.pool.begin().await?;
        let had_messages = sqlx::query(
            "UPDATE chat_users SET version = version + 1, message_count = 0, oldest_at = NULL
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
        let deleted = sqlx::query("DELETE FROM chat_messages WHERE tenant = $1 AND user_id = $2")
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
        let rows = sqlx::query(LIST_USERS)
            .bind(tenant.as_str())
            .bind(after.map_or("", UserId::as_str))
            .bind(i64::from(limit) + 1)
            .fetch_all(&self.pool)
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
        self.pool.close().await;
    }
}
