//! SQLite's read connections, kept between reads. sqlx checks every
//! connection given back to its pool with a round trip (a ping; on SQLite a
//! hop to the connection's worker thread and back, and a task to run it),
//! so a read that ends cleanly keeps its connection here for the next read
//! instead. One that fails, or whose caller went away mid-read, goes back
//! to the pool, which checks it as ever.
//!
//! Kept connections stay checked out of the pool, so the pool cannot hand
//! them to anyone who waits for one: every use of the read pool takes one
//! of as many permits as the pool has connections first. Whoever holds a
//! permit finds a connection kept here or, when none is, one the pool can
//! give (at most every other permit holder has one checked out).
//!
//! A connection kept for [`PING_WHEN_IDLE_FOR`] or longer is given back to
//! the pool when a read next comes, and the pool checks it, closes it once
//! idle long enough, and renews it, as it does every connection it holds.

use std::sync::{Arc, Mutex, MutexGuard};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool, Transaction};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::{PoolStatus, StoreError, PING_WHEN_IDLE_FOR};

/// Connections kept, each with when it was: the newest last.
type Kept<DB> = Arc<Mutex<Vec<(PoolConnection<DB>, Instant)>>>;

pub struct Readers<DB: Database> {
    pool: Pool<DB>,
    permits: Arc<Semaphore>,
    kept: Kept<DB>,
}

impl<DB: Database> Clone for Readers<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            permits: self.permits.clone(),
            kept: self.kept.clone(),
        }
    }
}

/// A read connection in use: [`Reader::keep`] it when the read ended
/// cleanly; dropped, it goes back to the pool.
pub struct Reader<DB: Database> {
    conn: PoolConnection<DB>,
    kept: Kept<DB>,
    permit: OwnedSemaphorePermit,
}

impl<DB: Database> Readers<DB> {
    pub fn new(pool: Pool<DB>) -> Self {
        let size = pool.options().get_max_connections();
        Self {
            permits: Arc::new(Semaphore::new(usize::try_from(size).unwrap_or(1).max(1))),
            pool,
            kept: Arc::default(),
        }
    }

    /// A connection, kept or from the pool, within the pool's acquire timeout.
    pub async fn acquire(&self) -> Result<Reader<DB>, StoreError> {
        let until = self.deadline();
        let permit = self.permit(until).await?;
        let conn = match self.take_kept() {
            Some(conn) => conn,
            None => within(until, self.pool.acquire()).await?,
        };
        Ok(Reader {
            conn,
            kept: self.kept.clone(),
            permit,
        })
    }

    /// A transaction begun with `begin` on a connection of the pool's own,
    /// and the permit to hold for as long as it lasts: a kept connection, if
    /// there is one, goes back to the pool first, so that it has one to give.
    pub async fn begin_with(
        &self,
        begin: &'static str,
    ) -> Result<(Transaction<'static, DB>, OwnedSemaphorePermit), StoreError> {
        let until = self.deadline();
        let permit = self.permit(until).await?;
        drop(self.take_kept());
        Ok((within(until, self.pool.begin_with(begin)).await?, permit))
    }

    /// One wait for the permit and the connection together.
    fn deadline(&self) -> Instant {
        Instant::now() + self.pool.options().get_acquire_timeout()
    }

    async fn permit(&self, until: Instant) -> Result<OwnedSemaphorePermit, StoreError> {
        let permits = self.permits.clone();
        let permit = within(until, async {
            let permit = permits.acquire_owned().await;
            permit.map_err(|_| sqlx::Error::PoolClosed)
        });
        Ok(permit.await?)
    }

    /// The newest connection kept, unless it has waited too long; those
    /// that have go back to the pool.
    fn take_kept(&self) -> Option<PoolConnection<DB>> {
        let now = Instant::now();
        let (stale, fresh) = {
            let mut kept = lock(&self.kept);
            let stale = kept
                .iter()
                .take_while(|(_, at)| now.duration_since(*at) >= PING_WHEN_IDLE_FOR)
                .count();
            let stale: Vec<_> = kept.drain(..stale).collect();
            (stale, kept.pop())
        };
        drop(stale);
        fresh.map(|(conn, _)| conn)
    }

    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The pool's figures, with the kept connections counted as idle.
    pub fn status(&self) -> PoolStatus {
        let status = PoolStatus::of(&self.pool);
        let kept = lock(&self.kept).len() as u64;
        PoolStatus {
            in_use: status.in_use.saturating_sub(kept),
            idle: status.idle + kept,
        }
    }

    /// Takes no more reads, gives the kept connections back, and closes
    /// the pool once the reads in flight have given theirs.
    pub async fn close(&self) {
        self.permits.close();
        drop(std::mem::take(&mut *lock(&self.kept)));
        self.pool.close().await;
    }
}

impl<DB: Database> Reader<DB> {
    pub fn conn(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }

    /// The read ended cleanly: the next one takes this connection as it is.
    pub fn keep(self) {
        let mut kept = lock(&self.kept);
        // Once the store closes, a connection kept would never be given back.
        if !self.permit.semaphore().is_closed() {
            kept.push((self.conn, Instant::now()));
        }
    }
}

/// `wait`, or the pool's timeout error once `until` passes.
async fn within<T>(
    until: Instant,
    wait: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    tokio::time::timeout_at(until, wait)
        .await
        .unwrap_or(Err(sqlx::Error::PoolTimedOut))
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding it; and a Vec is whole either way.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use sqlx::Sqlite;

    use super::*;

    fn kept(readers: &Readers<Sqlite>) -> usize {
        lock(&readers.kept).len()
    }

    #[tokio::test]
    async fn connections_kept_too_long_go_back_to_the_pool() {
        let file =
            std::env::temp_dir().join(format!("chat-history-readers-{}.db", std::process::id()));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(&file)
                    .create_if_missing(true),
            )
            .await
            .unwrap();
        let readers = Readers::new(pool);
        let (a, b) = (
            readers.acquire().await.unwrap(),
            readers.acquire().await.unwrap(),
        );
        a.keep();
        b.keep();
        assert_eq!(kept(&readers), 2);
        // A fresh one is taken as it is.
        readers.acquire().await.unwrap().keep();
        assert_eq!(kept(&readers), 2);
        tokio::time::sleep(PING_WHEN_IDLE_FOR + Duration::from_millis(100)).await;
        // Both waited too long: they go back, and the read takes one from the pool.
        let mut reader = readers.acquire().await.unwrap();
        assert_eq!(kept(&readers), 0);
        sqlx::query("SELECT 1")
            .execute(reader.conn())
            .await
            .unwrap();
        reader.keep();
        assert_eq!(kept(&readers), 1);
        readers.close().await;
        assert_eq!(kept(&readers), 0);
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
        }
    }
}
