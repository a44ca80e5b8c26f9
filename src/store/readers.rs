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

use std::sync::{Arc, Mutex, MutexGuard};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool, Transaction};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{PoolStatus, StoreError};

pub struct Readers<DB: Database> {
    pool: Pool<DB>,
    permits: Arc<Semaphore>,
    kept: Arc<Mutex<Vec<PoolConnection<DB>>>>,
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
    kept: Arc<Mutex<Vec<PoolConnection<DB>>>>,
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
        let permit = self.permit().await?;
        let kept = lock(&self.kept).pop();
        let conn = match kept {
            Some(conn) => conn,
            None => self.pool.acquire().await?,
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
        let permit = self.permit().await?;
        drop(lock(&self.kept).pop());
        Ok((self.pool.begin_with(begin).await?, permit))
    }

    async fn permit(&self) -> Result<OwnedSemaphorePermit, StoreError> {
        let wait = self.pool.options().get_acquire_timeout();
        match tokio::time::timeout(wait, self.permits.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err(sqlx::Error::PoolClosed.into()),
            Err(_) => Err(sqlx::Error::PoolTimedOut.into()),
        }
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
            kept.push(self.conn);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding it; and a Vec is whole either way.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
