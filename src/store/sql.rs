//! The one store. Every statement, loop, idempotency replay and row mapping
//! that both backends share lives here, generic over the [`Dialect`] that
//! says where their SQL really differs. sqlx's SQLite driver binds `$N`
//! like Postgres, so a statement both databases understand is one constant.
//!
//! Every write is a short transaction (`Dialect::BEGIN_WRITE`) whose first
//! statement locks the user's row; every read sees one snapshot.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::database::HasStatementCache;
use sqlx::migrate::Migrator;
use sqlx::pool::PoolConnection;
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{
    ColumnIndex, Database, Decode, Encode, Executor, FromRow, IntoArguments, Pool, Transaction,
    Type,
};
use tokio::sync::OwnedSemaphorePermit;

use super::batch::{run_with, Append, Batcher, Limits, PageBack, Server};
use super::readers::{Reader, Readers};
use super::recent::{Mark, RecentPages};
use super::{
    appended, assemble_page, db_count, forward_rows, latest_version, page_row, removes_too_many,
    row_count, saved, users_page, ConnectOptions, KeyRecord, MessageRecord, Page, PageCut,
    PoolStatus, RetentionReport, SeenKey, Store, StoreError, StoredRow, StreamSlots,
    TranscriptStream, UserRecord, UserRows,
};
use crate::domain::{
    extends_saved, transcript_digest, AppendOutcome, HistoryPage, HistoryQuery, Idempotency,
    IfMatch, NewMessage, SaveOutcome, StoredMessage, Tenant, Timestamp, UserId, UserStats,
    UserSummary,
};

/// Users locked and purged per retention transaction.
const PURGE_USERS_PER_BATCH: i64 = 100;
/// Messages deleted per retention transaction, at most: appends to those
/// users (and on SQLite every append) wait while a batch runs.
const PURGE_ROWS_PER_BATCH: i64 = 500;
/// Messages deleted per transaction when a user is cleared.
const CLEAR_ROWS_PER_BATCH: i64 = 2000;
/// Users listed per step of `clear_all`.
const CLEAR_USERS_PER_BATCH: i64 = 100;
/// Idempotency keys deleted per transaction.
const KEYS_PER_BATCH: i64 = 1000;
/// How long a retention lease lasts unless renewed; each batch renews it,
/// and a replica that dies holding it delays the next run by at most this.
const RETENTION_LEASE_SECONDS: i64 = 120;
/// The lease that lets one replica at a time run retention.
const RETENTION_LEASE: &str = "retention";

/// What a backend says in its own words: the statements whose SQL differs,
/// and the steps that take more than one shared statement.
#[async_trait]
pub trait Dialect: Database + HasStatementCache {
    /// Begins a transaction that writes.
    const BEGIN_WRITE: &'static str;
    /// Begins a read-only transaction that sees one snapshot throughout.
    const BEGIN_SNAPSHOT: &'static str;
    /// Whether `append` is one statement, safe outside a transaction.
    const ONE_STATEMENT_APPEND: bool;
    /// The database's clock, in microseconds since the Unix epoch.
    const NOW_MICROS: &'static str;
    /// Locks an existing user's row ($1 tenant, $2 user), returning its version.
    const LOCK_USER_ROW: &'static str;
    /// Locks up to `$3` users of tenant `$1` whose oldest message may be
    /// older than `$2`, returning their ids.
    const EXPIRED_USERS: &'static str;
    /// Deletes up to `$4` messages older than `$3` of the users `$2`
    /// (`Names`), returning the user of each. They are each user's oldest
    /// (`created_at` follows `seq`), so a scan of its primary-key range
    /// meets them first. A user whose few expired messages lie ahead of
    /// many live ones has those read too, by the batch that removes the
    /// expired ones (after it, `oldest_at` no longer lists the user).
    const DELETE_EXPIRED: &'static str;
    /// Takes the messages of the user list `$2` (one entry per message, as
    /// `DELETE_EXPIRED` returned) off their counts.
    const SUBTRACT_DELETED: &'static str;
    /// Sets `oldest_at` of the users `$2` from their oldest message.
    const REFRESH_OLDEST: &'static str;
    /// A page backwards: newest first below `$3`, at most `$4` rows
    /// ([`PAGE_BACK`] unless the dialect bounds its bytes).
    const PAGE_BACK: &'static str;
    /// A page forwards: oldest first after `$3` and below `$4`, at most `$5`
    /// rows ([`PAGE_FORWARD`] unless the dialect bounds its bytes).
    const PAGE_FORWARD: &'static str;
    /// Whether `PAGE_BACK` and `PAGE_FORWARD` take one more parameter, the
    /// page's byte budget, and leave out the rows after the first that does
    /// not fit it, so that a page cut short is not followed by rows that
    /// are read and sent only to be dropped. SQLite has no need: it steps
    /// no further than the rows the page takes.
    const PAGE_BYTES_IN_SQL: bool;

    /// A list of user ids as one bound value.
    type Names: for<'q> Encode<'q, Self> + Type<Self> + Send + Sync;
    fn names(users: &[String]) -> Self::Names;

    fn rows_affected(result: &Self::QueryResult) -> u64;

    fn migrator() -> &'static Migrator;

    async fn migrate(pool: &Pool<Self>, prepared: bool) -> Result<(), StoreError>;

    /// Bumps the user's counters by `messages` (creating the user) and
    /// inserts them after its last `seq`, at `max(now, last_created_at)`.
    async fn append(
        conn: &mut Self::Connection,
        prepared: bool,
        tenant: &Tenant,
        user: &UserId,
        messages: &[NewMessage],
        now: Timestamp,
    ) -> Result<Counters, StoreError>;

    /// Inserts messages exactly as given (a load: `seq`, `created_at` and
    /// digest each their own).
    async fn insert_records(
        conn: &mut Self::Connection,
        prepared: bool,
        tenant: &Tenant,
        user: &str,
        rows: &[MessageRecord],
    ) -> Result<(), StoreError>;

    /// Inserts `messages` with consecutive `seq` from `first_seq`.
    async fn insert_messages(
        conn: &mut Self::Connection,
        prepared: bool,
        tenant: &Tenant,
        user: &UserId,
        first_seq: i64,
        created_at: Timestamp,
        messages: &[NewMessage],
    ) -> Result<(), StoreError>;

    /// [`Dialect::append`] for each of two or more `appends`, in order, in
    /// the caller's write (or, where `ONE_STATEMENT_APPEND`, as one
    /// statement): the counters each would have read had they run one after
    /// another (see `fold.rs`).
    async fn append_many(
        conn: &mut Self::Connection,
        prepared: bool,
        appends: &[&Append],
    ) -> Result<Vec<Counters>, StoreError>;

    /// Whether every write shares one connection (SQLite's single
    /// writer), which a batching task must then not keep between batches.
    const SHARED_WRITER: bool;

    /// Whether `pages_back_many` reads many users' pages in one statement;
    /// where not, reads are not batched.
    const READS_MANY: bool;

    /// `PAGE_BACK` for each of `reads`, in one statement, with each user's
    /// mark: a read that comes with the user's mark as it still is (`known`)
    /// gets no rows, the page it holds being that one (see `recent.rs`).
    /// Each page is cut at `page_bytes` (see [`Page`]); the pages of the
    /// batch together keep at most [`BATCH_PAGE_BUDGETS`] times that, and
    /// a read whose rows did not fit comes back unread, to be made alone.
    async fn pages_back_many(
        conn: &mut Self::Connection,
        prepared: bool,
        reads: &[PageBack],
        known: &[Option<Mark>],
        page_bytes: usize,
    ) -> Result<Vec<CheckedPage>, StoreError>;

    /// Locks the rows of `users` (in key order, each once), creating those
    /// missing with no messages and `floor` as their time: how a batch that
    /// reads before it writes begins. SQLite's write transaction is already
    /// the lock.
    async fn lock_users(
        _conn: &mut Self::Connection,
        _prepared: bool,
        _users: &[(&str, &str)],
        _floor: Timestamp,
    ) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A user's counters, as every write that locks the user reads them.
#[derive(Debug, FromRow)]
pub struct Counters {
    pub last_seq: i64,
    pub version: i64,
    pub message_count: i64,
    pub last_created_at: Timestamp,
    pub transcript_digest: Option<Vec<u8>>,
}

#[derive(FromRow)]
struct StatsRow {
    message_count: i64,
    version: i64,
    first_seq: i64,
    last_seq: i64,
    oldest_at: Timestamp,
    newest_at: Timestamp,
}

/// Both backends' store: a pool for writes (and, on Postgres, reads), and
/// on SQLite a pool of read-only connections beside its single writer.
pub struct SqlStore<DB: Database> {
    pool: Pool<DB>,
    /// SQLite's read-only connections (Postgres reads from `pool`).
    readers: Option<Readers<DB>>,
    /// Named, cached statements; false behind a pooler in transaction mode.
    prepared: bool,
    /// Where a history page is cut (`ConnectOptions::page_bytes`).
    page_bytes: usize,
    streams: StreamSlots,
    /// Who holds the retention lease when this store does.
    holder: String,
    /// Where appends and reads queue to be served together; `None` in the
    /// batching tasks' own copy of the store, which serves them.
    batches: Option<Arc<Batches>>,
}

/// A page as `Dialect::pages_back_many` reads it: the user's mark (none
/// for a user never written), and its rows, newest first, or none when the
/// mark was still the one the read came with.
pub struct CheckedPage {
    pub mark: Option<Mark>,
    pub rows: Option<Page>,
}

/// The bodies one batched read statement keeps, at most, in pages' byte
/// budgets (`CHAT_HISTORY_MAX_PAGE_BYTES`), beside the first row it reads.
pub const BATCH_PAGE_BUDGETS: usize = 4;

/// Appends share commits; on a dialect that reads many users' pages in one
/// statement, reads of the newest messages share statements.
struct Batches {
    commits: Batcher<Append, AppendOutcome>,
    pages: Option<Batcher<PageBack, Page>>,
    /// The pages the reads keep, which appends follow.
    recent: Option<Arc<RecentPages>>,
}

/// Messages in one shared commit, at most (unless one append has more).
const COMMIT_MESSAGES: usize = 10_000;
/// Page reads in one statement, at most, and statements in flight at once:
/// two, so that the service decodes one batch while Postgres runs the next.
/// Measured on 2 cores (`scripts/bench --only postgres --also`, one run):
/// 1, 4 and 8 lanes read 0.93, 0.82 and 0.71 as many pages a second at 8
/// reads in flight as two do; more lanes make smaller statements, each
/// costing the service and Postgres their fixed share again.
const READ_BATCH: usize = 64;
const READ_LANES: usize = 2;
/// The smallest pool whose connections batching lanes keep between batches.
const KEEP_FROM_POOL_SIZE: u32 = 4;

/// The store without its batching tasks: what those tasks run with.
impl<DB: Database> Clone for SqlStore<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            readers: self.readers.clone(),
            prepared: self.prepared,
            page_bytes: self.page_bytes,
            streams: self.streams.clone(),
            holder: self.holder.clone(),
            batches: None,
        }
    }
}

/// A connection for statements that need no transaction of their own: a
/// plain connection (from the pool, or one the caller holds), or behind a
/// transaction-mode pooler a transaction, so that a statement's parse and
/// execute reach the same server connection.
enum Session<'c, DB: Database> {
    Pooled(PoolConnection<DB>),
    Kept(Reader<DB>),
    Held(&'c mut DB::Connection),
    Pinned(Transaction<'c, DB>),
}

impl<DB: Database> Session<'_, DB> {
    fn conn(&mut self) -> &mut DB::Connection {
        match self {
            Self::Pooled(conn) => conn,
            Self::Kept(reader) => reader.conn(),
            Self::Held(conn) => conn,
            Self::Pinned(tx) => tx,
        }
    }

    async fn done(self) -> Result<(), StoreError> {
        match self {
            Self::Pinned(tx) => tx.commit().await?,
            Self::Kept(reader) => reader.keep(),
            Self::Pooled(_) | Self::Held(_) => {}
        }
        Ok(())
    }
}

/// A connection a batching lane keeps from one batch to the next, so that
/// no batch pays for giving it back (sqlx pings every connection returned
/// to its pool: a round trip). Dropped after a failed batch, and checked
/// first when it sat idle, as the pools check theirs.
pub struct Lane<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    used: std::time::Instant,
}

impl<DB: Database> Default for Lane<DB> {
    fn default() -> Self {
        Self {
            conn: None,
            used: std::time::Instant::now(),
        }
    }
}

impl<DB: Database> Lane<DB> {
    /// The lane's connection, or one from `pool`.
    async fn conn(&mut self, pool: &Pool<DB>) -> Result<&mut PoolConnection<DB>, StoreError> {
        use sqlx::Connection as _;
        let idle = self.used.elapsed() >= super::PING_WHEN_IDLE_FOR;
        self.used = std::time::Instant::now();
        let conn = match self.conn.take() {
            Some(mut conn) if idle => match conn.ping().await {
                Ok(()) => conn,
                Err(_) => pool.acquire().await?,
            },
            Some(conn) => conn,
            None => pool.acquire().await?,
        };
        Ok(self.conn.insert(conn))
    }

    /// Ends a batch: a connection whose batch failed may be broken, and
    /// goes back to the pool (which checks it); so does one that others
    /// need between batches (`keep` false).
    fn release(&mut self, failed: bool, keep: bool) {
        if failed || !keep {
            self.conn = None;
        }
    }
}

/// The database's clock as read at the start of a run, moved on by this
/// process's monotonic clock: lease times without a round trip each.
struct Clock {
    at: Timestamp,
    read: std::time::Instant,
}

impl Clock {
    fn now(&self) -> Timestamp {
        let elapsed = i64::try_from(self.read.elapsed().as_micros()).unwrap_or(i64::MAX);
        Timestamp::from_micros(self.at.as_micros().saturating_add(elapsed))
    }
}

impl<DB: Database> SqlStore<DB> {
    pub(super) fn new(
        pool: Pool<DB>,
        readers: Option<Pool<DB>>,
        prepared: bool,
        options: &ConnectOptions,
    ) -> Self {
        Self {
            pool,
            readers: readers.map(Readers::new),
            prepared,
            page_bytes: options.page_bytes,
            streams: StreamSlots::new(options.max_connections),
            holder: lease_holder(),
            batches: None,
        }
    }
}

impl<DB> SqlStore<DB>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Timestamp: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
    for<'a> &'a str: ColumnIndex<DB::Row>,
{
    /// The store, its appends (and, where the dialect reads many pages in
    /// one statement, its page reads) served in batches by tasks of its own
    /// (see `batch.rs`). With `commit_batch` at 1 each append commits alone
    /// and reads are not coalesced either: every statement then names one
    /// user, as a sharded Postgres (Citus) needs.
    pub(super) fn with_batching(
        mut self,
        commit_batch: usize,
        recent: Option<Arc<RecentPages>>,
    ) -> Self {
        let store = Arc::new(self.clone());
        // Lanes keep their connections only where the pools can spare them:
        // never SQLite's one writer, and Postgres's from a pool of four up,
        // so that the rest of the service always has connections of its own.
        let spare = |pool: &Pool<DB>| pool.options().get_max_connections() >= KEEP_FROM_POOL_SIZE;
        let keep_writer = !DB::SHARED_WRITER && spare(&self.pool);
        let keep_reader = spare(self.readers.as_ref().map_or(&self.pool, Readers::pool));
        let writer = store.clone();
        let commits = Batcher::start(
            Server {
                kind: "commit",
                weight: |a: &Append| a.messages.len(),
                run: run_with(move |lane: &mut Lane<DB>, batch| {
                    let store = writer.clone();
                    Box::pin(async move {
                        let conn = lane.conn(&store.pool).await?;
                        let written = store.commit(conn, batch).await;
                        lane.release(written.is_err(), keep_writer);
                        written
                    })
                }),
            },
            Limits {
                items: commit_batch.max(1),
                weight: COMMIT_MESSAGES,
                // One commit in flight. A second (measured on Postgres, 2
                // cores, 64 appends in flight) made the batches smaller,
                // cost Postgres 30–45 % more CPU per append, served fewer.
                lanes: 1,
            },
        );
        let reads_many = DB::READS_MANY && commit_batch > 1;
        let recent = recent.filter(|_| reads_many);
        let kept = recent.clone();
        let pages = reads_many.then(|| {
            Batcher::start(
                Server {
                    kind: "read",
                    weight: |_: &PageBack| 1,
                    run: run_with(move |lane: &mut Lane<DB>, batch| {
                        let (store, recent) = (store.clone(), kept.clone());
                        Box::pin(async move {
                            // Only Postgres reads many pages at once; it has no `readers`.
                            let pool = &store.pool;
                            let conn = lane.conn(pool).await?;
                            let session = store.session_on(conn).await?;
                            let pages = store.pages_back(session, batch, recent.as_deref()).await;
                            lane.release(pages.is_err(), keep_reader);
                            pages
                        })
                    }),
                },
                Limits {
                    items: READ_BATCH,
                    weight: READ_BATCH,
                    lanes: READ_LANES,
                },
            )
        });
        self.batches = Some(Arc::new(Batches {
            commits,
            pages,
            recent,
        }));
        self
    }

    /// Pages backwards for a batch of reads: one read with no `recent`
    /// pages is `PAGE_BACK`, as ever; otherwise one statement of the
    /// dialect's serves all of them, checking the pages `recent` holds.
    async fn pages_back(
        &self,
        mut session: Session<'_, DB>,
        batch: &[PageBack],
        recent: Option<&RecentPages>,
    ) -> Result<Vec<Page>, StoreError> {
        if let ([one], None) = (batch, recent) {
            let query = self
                .user_rows(DB::PAGE_BACK, &one.tenant, one.user.as_str())
                .bind(one.below)
                .bind(one.fetch);
            let page = self.read_page(query, session.conn()).await?;
            session.done().await?;
            return Ok(vec![page]);
        }
        let kept: Vec<_> = batch
            .iter()
            .map(|read| recent.and_then(|r| r.lookup(read)))
            .collect();
        let known: Vec<Option<Mark>> = kept.iter().map(|k| k.as_ref().map(|k| k.mark)).collect();
        let checked = DB::pages_back_many(
            session.conn(),
            self.prepared,
            batch,
            &known,
            self.page_bytes,
        )
        .await?;
        session.done().await?;
        let mut hits = 0;
        let pages = batch
            .iter()
            .zip(kept)
            .zip(checked)
            .map(|((read, kept), page)| match (page.rows, kept) {
                (Some(rows), _) => {
                    // A cut page is not the user's newest `fetch`: not kept.
                    if let (Some((recent, mark)), None) = (recent.zip(page.mark), rows.cut) {
                        recent.keep(read, mark, &rows.rows);
                    }
                    Ok(rows)
                }
                (None, Some(kept)) => {
                    hits += 1;
                    Ok(PageCut::all(self.page_bytes, kept.page(read)))
                }
                (None, None) => Err(StoreError::Corrupt(
                    "a page read came back unread with no page kept for it".into(),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if recent.is_some() {
            metrics::counter!("chat_history_read_cache_total", "outcome" => "hit").increment(hits);
            metrics::counter!("chat_history_read_cache_total", "outcome" => "miss")
                .increment(batch.len() as u64 - hits);
        }
        Ok(pages)
    }

    /// A batch of appends in one write. Appends with neither a cap nor a
    /// key are written together (on Postgres, one statement for every user
    /// of the batch, each user's appends folded in arrival order); with a
    /// cap or a key in the batch, every user is locked first, in key order,
    /// so that two replicas' batches never wait for each other in a cycle,
    /// and those appends then run one by one.
    async fn commit(
        &self,
        conn: &mut DB::Connection,
        batch: &[Append],
    ) -> Result<Vec<AppendOutcome>, StoreError> {
        use sqlx::Connection as _;
        if let [one] = batch {
            return Ok(vec![self.append_alone(conn, one).await?]);
        }
        let plain: Vec<&Append> = batch.iter().filter(|a| a.is_plain()).collect();
        if DB::ONE_STATEMENT_APPEND && plain.len() == batch.len() {
            // One statement: atomic on its own, one round trip for all.
            let mut session = self.session_on(conn).await?;
            let counters = self.append_plain(session.conn(), &plain).await?;
            session.done().await?;
            return plain
                .iter()
                .zip(counters)
                .map(|(a, c)| Ok(AppendOutcome::Stored(stored(a, c)?)))
                .collect();
        }
        let mut tx = conn.begin_with(DB::BEGIN_WRITE).await?;
        if plain.len() < batch.len() {
            let mut users: Vec<(&str, &str)> = batch
                .iter()
                .map(|a| (a.tenant.as_str(), a.user.as_str()))
                .collect();
            users.sort_unstable();
            users.dedup();
            let floor = batch
                .iter()
                .map(|a| a.now)
                .min()
                .unwrap_or(Timestamp::from_micros(0));
            DB::lock_users(&mut tx, self.prepared, &users, floor).await?;
        }
        let counters = self.append_plain(&mut tx, &plain).await?;
        let mut written = plain.iter().zip(counters);
        let mut outcomes = Vec::with_capacity(batch.len());
        for a in batch {
            let outcome = if a.is_plain() {
                let (a, counters) = written.next().ok_or_else(|| {
                    StoreError::Corrupt("an append of the batch was not written".into())
                })?;
                AppendOutcome::Stored(stored(a, counters)?)
            } else {
                self.append_in(&mut tx, a).await?
            };
            outcomes.push(outcome);
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    /// The plain appends of a batch: `APPEND` alone for one (on Postgres
    /// the statement Citus routes to one shard), the dialect's
    /// `append_many` for more.
    async fn append_plain(
        &self,
        conn: &mut DB::Connection,
        plain: &[&Append],
    ) -> Result<Vec<Counters>, StoreError> {
        match plain {
            [] => Ok(Vec::new()),
            [a] => {
                let counters =
                    DB::append(conn, self.prepared, &a.tenant, &a.user, &a.messages, a.now).await?;
                Ok(vec![counters])
            }
            _ => DB::append_many(conn, self.prepared, plain).await,
        }
    }

    /// One append in a write of its own: with neither a cap nor a key, and
    /// a dialect whose append is one statement, that statement alone.
    async fn append_alone(
        &self,
        conn: &mut DB::Connection,
        a: &Append,
    ) -> Result<AppendOutcome, StoreError> {
        use sqlx::Connection as _;
        if DB::ONE_STATEMENT_APPEND && a.is_plain() {
            let mut session = self.session_on(conn).await?;
            let counters = DB::append(
                session.conn(),
                self.prepared,
                &a.tenant,
                &a.user,
                &a.messages,
                a.now,
            )
            .await?;
            session.done().await?;
            return Ok(AppendOutcome::Stored(stored(a, counters)?));
        }
        let mut tx = conn.begin_with(DB::BEGIN_WRITE).await?;
        let outcome = self.append_in(&mut tx, a).await?;
        tx.commit().await?;
        Ok(outcome)
    }

    /// One append inside the caller's write: a key already seen replays
    /// (or refuses) and stores nothing; else the messages go after the
    /// user's last, the oldest past the cap are evicted, and the key is
    /// remembered.
    async fn append_in(
        &self,
        conn: &mut DB::Connection,
        a: &Append,
    ) -> Result<AppendOutcome, StoreError> {
        let (tenant, user) = (&a.tenant, a.user.as_str());
        if let Some(key) = &a.idempotency {
            // Lock the user first: a concurrent request with the same key
            // waits here, then finds the record this one leaves.
            self.user(LOCK_USER, tenant, user)
                .bind(a.now)
                .execute(&mut *conn)
                .await?;
            let seen: Option<SeenKey> = self
                .user_rows(SEEN_KEY, tenant, user)
                .bind(key.key())
                .fetch_optional(&mut *conn)
                .await?;
            if let Some(seen) = seen {
                return seen.outcome(key, &a.messages);
            }
        }
        let counters = DB::append(
            &mut *conn,
            self.prepared,
            tenant,
            &a.user,
            &a.messages,
            a.now,
        )
        .await?;
        if let Some(cap) = a.cap {
            let excess = counters.message_count - db_count(cap);
            self.evict_oldest(&mut *conn, tenant, &a.user, excess)
                .await?;
        }
        let result = stored(a, counters)?;
        if let Some(key) = &a.idempotency {
            self.user(REMEMBER_KEY, tenant, user)
                .bind(key.key())
                .bind(key.request_digest().to_vec())
                .bind(result.messages[0].seq)
                .bind(result.messages[0].created_at)
                .bind(result.version)
                .bind(a.now)
                .execute(&mut *conn)
                .await?;
        }
        Ok(AppendOutcome::Stored(result))
    }

    /// A statement about one user: `$1` the tenant, `$2` the user.
    fn user<'q>(
        &self,
        sql: &'q str,
        tenant: &'q Tenant,
        user: &'q str,
    ) -> Query<'q, DB, DB::Arguments<'q>> {
        sqlx::query(sql)
            .persistent(self.prepared)
            .bind(tenant.as_str())
            .bind(user)
    }

    fn user_scalar<'q, O>(
        &self,
        sql: &'q str,
        tenant: &'q Tenant,
        user: &'q str,
    ) -> QueryScalar<'q, DB, O, DB::Arguments<'q>>
    where
        (O,): for<'r> FromRow<'r, DB::Row>,
    {
        self.scalar(sql).bind(tenant.as_str()).bind(user)
    }

    fn user_rows<'q, O>(
        &self,
        sql: &'q str,
        tenant: &'q Tenant,
        user: &'q str,
    ) -> QueryAs<'q, DB, O, DB::Arguments<'q>>
    where
        O: for<'r> FromRow<'r, DB::Row>,
    {
        sqlx::query_as(sql)
            .persistent(self.prepared)
            .bind(tenant.as_str())
            .bind(user)
    }

    /// Reads the rows of `query`, a page in its direction, only until the
    /// page's bytes are full: SQLite stops there, and the rows Postgres
    /// still sends are dropped as they come, so a page never holds more
    /// than its budget (and one message).
    async fn read_page<'q>(
        &self,
        query: QueryAs<'q, DB, StoredRow, DB::Arguments<'q>>,
        conn: &mut DB::Connection,
    ) -> Result<Page, StoreError> {
        use futures_util::TryStreamExt;
        let query = if DB::PAGE_BYTES_IN_SQL {
            query.bind(i64::try_from(self.page_bytes).unwrap_or(i64::MAX))
        } else {
            query
        };
        let mut rows = query.fetch(conn);
        let mut cut = PageCut::new(self.page_bytes);
        while let Some(row) = rows.try_next().await? {
            if !cut.offer(page_row(row)?) {
                break;
            }
        }
        Ok(cut.page)
    }

    fn scalar<'q, O>(&self, sql: &'q str) -> QueryScalar<'q, DB, O, DB::Arguments<'q>>
    where
        (O,): for<'r> FromRow<'r, DB::Row>,
    {
        sqlx::query_scalar(sql).persistent(self.prepared)
    }

    /// A connection for reading: SQLite's read-only pool, else a session.
    async fn reader(&self) -> Result<Session<'static, DB>, StoreError> {
        match &self.readers {
            Some(readers) => Ok(Session::Kept(readers.acquire().await?)),
            None => self.session().await,
        }
    }

    async fn session(&self) -> Result<Session<'static, DB>, StoreError> {
        Ok(if self.prepared {
            Session::Pooled(self.pool.acquire().await?)
        } else {
            Session::Pinned(self.pool.begin().await?)
        })
    }

    /// A session on a connection the caller holds.
    async fn session_on<'c>(
        &self,
        conn: &'c mut DB::Connection,
    ) -> Result<Session<'c, DB>, StoreError> {
        use sqlx::Connection as _;
        Ok(if self.prepared {
            Session::Held(conn)
        } else {
            Session::Pinned(conn.begin().await?)
        })
    }

    async fn write(&self) -> Result<Transaction<'static, DB>, StoreError> {
        Ok(self.pool.begin_with(DB::BEGIN_WRITE).await?)
    }

    /// The database's clock: cutoffs are taken from it, never from a replica's.
    async fn database_now(&self) -> Result<Clock, StoreError> {
        let mut session = self.reader().await?;
        let micros: i64 = self
            .scalar(DB::NOW_MICROS)
            .fetch_one(session.conn())
            .await?;
        session.done().await?;
        Ok(Clock {
            at: Timestamp::from_micros(micros),
            read: std::time::Instant::now(),
        })
    }

    /// Takes or renews the retention lease for `RETENTION_LEASE_SECONDS`
    /// inside the caller's write; false while another replica holds it.
    async fn renew_lease(
        &self,
        conn: &mut DB::Connection,
        clock: &Clock,
    ) -> Result<bool, StoreError> {
        let now = clock.now();
        let expires = Timestamp::from_micros(
            now.as_micros()
                .saturating_add(RETENTION_LEASE_SECONDS * 1_000_000),
        );
        let taken = sqlx::query(TAKE_LEASE)
            .persistent(self.prepared)
            .bind(RETENTION_LEASE)
            .bind(self.holder.as_str())
            .bind(expires)
            .bind(now)
            .execute(conn)
            .await?;
        Ok(DB::rows_affected(&taken) == 1)
    }

    /// Runs `renew_lease` in a write of its own.
    async fn take_lease(&self, clock: &Clock) -> Result<bool, StoreError> {
        let mut tx = self.write().await?;
        let taken = self.renew_lease(&mut tx, clock).await?;
        tx.commit().await?;
        Ok(taken)
    }

    async fn release_lease(&self) -> Result<(), StoreError> {
        let mut tx = self.write().await?;
        sqlx::query("DELETE FROM chat_leases WHERE name = $1 AND holder = $2")
            .persistent(self.prepared)
            .bind(RETENTION_LEASE)
            .bind(self.holder.as_str())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Deletes the tenant's messages created before `cutoff`, a bounded batch
    /// of users and rows per write. With a `lease` (the retention run's) each
    /// batch first renews it, and the purge ends with `LeaseLost` once it is lost.
    async fn purge_before(
        &self,
        tenant: &Tenant,
        cutoff: Timestamp,
        lease: Option<&Clock>,
    ) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let mut tx = self.write().await?;
            if let Some(clock) = lease {
                if !self.renew_lease(&mut tx, clock).await? {
                    return Err(StoreError::LeaseLost(total));
                }
            }
            let users: Vec<String> = self
                .scalar(DB::EXPIRED_USERS)
                .bind(tenant.as_str())
                .bind(cutoff)
                .bind(PURGE_USERS_PER_BATCH)
                .fetch_all(&mut *tx)
                .await?;
            if users.is_empty() {
                tx.commit().await?;
                return Ok(total);
            }
            let gone: Vec<String> = self
                .scalar(DB::DELETE_EXPIRED)
                .bind(tenant.as_str())
                .bind(DB::names(&users))
                .bind(cutoff)
                .bind(PURGE_ROWS_PER_BATCH)
                .fetch_all(&mut *tx)
                .await?;
            for (statement, names) in [(DB::SUBTRACT_DELETED, &gone), (DB::REFRESH_OLDEST, &users)]
            {
                sqlx::query(statement)
                    .persistent(self.prepared)
                    .bind(tenant.as_str())
                    .bind(DB::names(names))
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            total += gone.len() as u64;
        }
    }

    /// One retention run, the lease held: renewed by every batch, and a
    /// lease lost (a batch outlasted it) ends the run early.
    async fn retention_work(
        &self,
        clock: &Clock,
        retention: Option<Duration>,
        keys_ttl: Duration,
    ) -> Result<RetentionReport, StoreError> {
        let mut report = RetentionReport::default();
        if let Some(retention) = retention {
            let cutoff = clock.at.minus_seconds(retention.as_secs());
            let mut session = self.reader().await?;
            let tenants: Vec<String> = self.scalar(TENANTS).fetch_all(session.conn()).await?;
            session.done().await?;
            for tenant in tenants {
                match self
                    .purge_before(&Tenant::new(tenant), cutoff, Some(clock))
                    .await
                {
                    Ok(purged) => report.messages += purged,
                    // Another replica has the lease now: the run ends here.
                    Err(StoreError::LeaseLost(purged)) => {
                        report.messages += purged;
                        return Ok(report);
                    }
                    Err(other) => return Err(other),
                }
            }
        }
        let keys_cutoff = clock.at.minus_seconds(keys_ttl.as_secs());
        loop {
            let mut tx = self.write().await?;
            if !self.renew_lease(&mut tx, clock).await? {
                return Ok(report);
            }
            let deleted = sqlx::query(DELETE_OLD_KEYS)
                .persistent(self.prepared)
                .bind(keys_cutoff)
                .bind(KEYS_PER_BATCH)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            let deleted = DB::rows_affected(&deleted);
            report.idempotency_keys += deleted;
            if deleted == 0 {
                return Ok(report);
            }
        }
    }

    /// Deletes the user's `excess` oldest messages (if any) inside the
    /// caller's write, whose first statement locked the user; says how many went.
    async fn evict_oldest(
        &self,
        conn: &mut DB::Connection,
        tenant: &Tenant,
        user: &UserId,
        excess: i64,
    ) -> Result<u64, StoreError> {
        if excess <= 0 {
            return Ok(0);
        }
        let evicted = self
            .user(EVICT_OLDEST, tenant, user.as_str())
            .bind(excess)
            .execute(&mut *conn)
            .await?;
        let evicted = DB::rows_affected(&evicted);
        self.user(SUBTRACT_EVICTED, tenant, user.as_str())
            .bind(db_count(evicted))
            .execute(&mut *conn)
            .await?;
        Ok(evicted)
    }

    /// Deletes the user's messages up to its newest one now, a bounded batch
    /// per write, so that clearing a long history never holds a writer for
    /// long; appends arriving meanwhile are kept.
    async fn clear(&self, tenant: &Tenant, user: &str) -> Result<u64, StoreError> {
        let mut session = self.reader().await?;
        let through: Option<i64> = self
            .user_scalar(
                "SELECT last_seq FROM chat_users
                 WHERE tenant = $1 AND user_id = $2 AND message_count > 0",
                tenant,
                user,
            )
            .fetch_optional(session.conn())
            .await?;
        session.done().await?;
        let Some(through) = through else {
            return Ok(0);
        };
        let mut total = 0;
        loop {
            let mut tx = self.write().await?;
            self.user(DB::LOCK_USER_ROW, tenant, user)
                .execute(&mut *tx)
                .await?;
            let deleted = self
                .user(CLEAR_BATCH, tenant, user)
                .bind(through)
                .bind(CLEAR_ROWS_PER_BATCH)
                .execute(&mut *tx)
                .await?;
            let deleted = DB::rows_affected(&deleted);
            if deleted == 0 {
                tx.rollback().await?;
                return Ok(total);
            }
            self.user(SUBTRACT_CLEARED, tenant, user)
                .bind(db_count(deleted))
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            total += deleted;
            if deleted < CLEAR_ROWS_PER_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    /// The transcript of `user` from the snapshot of `tx`: the version and
    /// count now, the rows sent on by a task that holds `slot` (and the read
    /// pool's permit, if any) and `tx` until the reader has them all, goes
    /// away, or `until` passes.
    async fn stream_transcript(
        &self,
        mut tx: Transaction<'static, DB>,
        slot: (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>),
        tenant: &Tenant,
        user: &UserId,
        until: tokio::time::Instant,
    ) -> Result<TranscriptStream, StoreError> {
        let (version, count): (i64, i64) = self
            .user_rows(TRANSCRIPT_HEAD, tenant, user.as_str())
            .fetch_optional(&mut *tx)
            .await?
            .unwrap_or((0, 0));
        let (stream, sender) = TranscriptStream::new(version, count);
        if count > 0 {
            let (tenant, user) = (tenant.as_str().to_owned(), user.as_str().to_owned());
            let prepared = self.prepared;
            tokio::spawn(async move {
                let _slot = slot;
                let rows = sqlx::query_scalar(TRANSCRIPT_ROWS)
                    .persistent(prepared)
                    .bind(tenant)
                    .bind(user)
                    .fetch(&mut *tx);
                forward_rows(rows, sender, until).await;
            });
        }
        Ok(stream)
    }
}

#[async_trait]
impl<DB> Store for SqlStore<DB>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Timestamp: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
    for<'a> &'a str: ColumnIndex<DB::Row>,
    for<'q> Option<Timestamp>: Encode<'q, DB>,
    for<'q> Option<Vec<u8>>: Encode<'q, DB>,
{
    async fn migrate(&self) -> Result<(), StoreError> {
        DB::migrate(&self.pool, self.prepared).await
    }

    async fn ready(&self) -> Result<(), StoreError> {
        let mut session = self.reader().await?;
        let applied: Option<i64> = self
            .scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(session.conn())
            .await
            .or_else(|e| {
                if is_missing_table(&e) {
                    Ok(None)
                } else {
                    Err(e)
                }
            })?;
        // A failed statement has aborted a pinned transaction: nothing to commit.
        if applied.is_some() {
            session.done().await?;
        }
        let expected = latest_version(DB::migrator());
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
        let append = Append {
            tenant: tenant.clone(),
            user: user.clone(),
            messages: messages.to_vec(),
            now,
            cap,
            idempotency: idempotency.cloned(),
        };
        match &self.batches {
            Some(batches) => {
                let outcome = batches.commits.submit(append).await?;
                if let (Some(recent), AppendOutcome::Stored(stored), None) =
                    (&batches.recent, &outcome, cap)
                {
                    recent.follow_append(tenant, user, stored.version, &stored.messages);
                }
                Ok(outcome)
            }
            None => {
                let mut conn = self.pool.acquire().await?;
                self.append_alone(&mut conn, &append).await
            }
        }
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
        let (tx, permit) = match &self.readers {
            Some(readers) => {
                let (tx, permit) = readers.begin_with(DB::BEGIN_SNAPSHOT).await?;
                (tx, Some(permit))
            }
            None => (self.pool.begin_with(DB::BEGIN_SNAPSHOT).await?, None),
        };
        self.stream_transcript(tx, (slot, permit), tenant, user, until)
            .await
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
        let counters: Counters = self
            .user_rows(LOCK_USER, tenant, user.as_str())
            .bind(now)
            .fetch_one(&mut *tx)
            .await?;
        let (version, stored) = (counters.version, row_count(counters.message_count));
        if if_match.is_some_and(|c| !c.admits(version, counters.message_count)) {
            tx.rollback().await?;
            return Ok(SaveOutcome::PreconditionFailed {
                current_version: version,
            });
        }
        // At most `messages.len()` can be kept: refuse before comparing.
        if let Some(refused) = removes_too_many(stored, messages.len(), max_removed) {
            tx.rollback().await?;
            return Ok(refused);
        }
        let known = counters.transcript_digest.as_deref();
        let difference: Option<(i64, i64)> = if extends_saved(known, stored, messages) {
            // What the last save stored is a prefix of this transcript.
            None
        } else {
            let incoming: Vec<u8> = messages.iter().flat_map(|m| m.digest()).collect();
            self.user_rows(FIRST_DIFFERENCE, tenant, user.as_str())
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
            self.user(
                "DELETE FROM chat_messages WHERE tenant = $1 AND user_id = $2 AND seq >= $3",
                tenant,
                user.as_str(),
            )
            .bind(first_removed)
            .execute(&mut *tx)
            .await?;
        }
        let new = &messages[kept..];
        let created_at = now.max(counters.last_created_at);
        let first_seq = counters.last_seq + 1;
        DB::insert_messages(
            &mut tx,
            self.prepared,
            tenant,
            user,
            first_seq,
            created_at,
            new,
        )
        .await?;
        let version: i64 = self
            .user_scalar(FINISH_SAVE, tenant, user.as_str())
            .bind(db_count(new.len()))
            .bind(db_count(messages.len()))
            .bind(created_at)
            .bind(transcript_digest(messages).to_vec())
            .fetch_one(&mut *tx)
            .await?;
        let evicted = match cap {
            Some(cap) => {
                let excess = db_count(messages.len()) - db_count(cap);
                self.evict_oldest(&mut tx, tenant, user, excess).await?
            }
            None => 0,
        };
        tx.commit().await?;
        Ok(saved(version, stored, messages.len(), kept, evicted))
    }

    async fn purge_expired(&self, tenant: &Tenant, max_age: Duration) -> Result<u64, StoreError> {
        let cutoff = self
            .database_now()
            .await?
            .at
            .minus_seconds(max_age.as_secs());
        self.purge_before(tenant, cutoff, None).await
    }

    async fn clear_all(&self, tenant: &Tenant) -> Result<u64, StoreError> {
        // User by user, moving forward by key so that appends arriving
        // meanwhile cannot keep it going.
        let mut total = 0;
        let mut after = String::new();
        loop {
            let mut session = self.reader().await?;
            let users: Vec<String> = self
                .user_scalar(
                    "SELECT user_id FROM chat_users WHERE tenant = $1 AND user_id > $2
                     AND message_count > 0 ORDER BY user_id LIMIT $3",
                    tenant,
                    &after,
                )
                .bind(CLEAR_USERS_PER_BATCH)
                .fetch_all(session.conn())
                .await?;
            session.done().await?;
            let Some(last) = users.last() else {
                return Ok(total);
            };
            after = last.clone();
            for user in &users {
                total += self.clear(tenant, user).await?;
            }
        }
    }

    async fn retention_pass(
        &self,
        retention: Option<Duration>,
        keys_ttl: Duration,
    ) -> Result<Option<RetentionReport>, StoreError> {
        // The lock is a lease row, not a session lock: it must hold behind a
        // pooler in transaction mode too, where no session is ours for long.
        // Every step takes one connection and gives it back, so a pool of
        // one connection is enough and SQLite's writer is never held between batches.
        let clock = self.database_now().await?;
        if !self.take_lease(&clock).await? {
            return Ok(None);
        }
        let report = self.retention_work(&clock, retention, keys_ttl).await;
        let released = self.release_lease().await;
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
        let page = match query.after {
            None => {
                let read = PageBack {
                    tenant: tenant.clone(),
                    user: user.clone(),
                    below: before,
                    fetch,
                };
                let batched = match self.batches.as_ref().and_then(|b| b.pages.as_ref()) {
                    Some(pages) => Some(pages.submit(read.clone()).await?),
                    None => None,
                };
                match batched {
                    Some(page) if !page.unread() => page,
                    // Not batched, or its rows did not fit its batch's bytes.
                    _ => {
                        let session = self.reader().await?;
                        let mut pages = self
                            .pages_back(session, std::slice::from_ref(&read), None)
                            .await?;
                        pages.pop().unwrap_or_default()
                    }
                }
            }
            Some(after) => {
                let mut session = self.reader().await?;
                let window_start: Option<i64> = match query.not_before {
                    Some(not_before) => {
                        self.user_scalar(WINDOW_START, tenant, user.as_str())
                            .bind(not_before)
                            // Seqs start at 1; far from overflowing either way,
                            // and never below 0, where `/ 2` rounds up.
                            .bind(after.clamp(0, i64::MAX / 4))
                            .fetch_optional(session.conn())
                            .await?
                    }
                    None => Some(after.saturating_add(1)),
                };
                let page = match window_start {
                    None => Page::default(),
                    Some(start) => {
                        let query = self
                            .user_rows(DB::PAGE_FORWARD, tenant, user.as_str())
                            .bind(after.max(start - 1))
                            .bind(before)
                            .bind(fetch);
                        self.read_page(query, session.conn()).await?
                    }
                };
                session.done().await?;
                page
            }
        };
        Ok(assemble_page(page, query))
    }

    async fn message(
        &self,
        tenant: &Tenant,
        user: &UserId,
        seq: i64,
    ) -> Result<Option<StoredMessage>, StoreError> {
        let mut session = self.reader().await?;
        let row: Option<(Timestamp, String)> = self
            .user_rows(
                "SELECT created_at, message FROM chat_messages
                 WHERE tenant = $1 AND user_id = $2 AND seq = $3",
                tenant,
                user.as_str(),
            )
            .bind(seq)
            .fetch_optional(session.conn())
            .await?;
        session.done().await?;
        row.map(|(at, body)| {
            StoredMessage::new(seq, at, body).map_err(|e| StoreError::Corrupt(e.to_string()))
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
        let locked: Option<i64> = self
            .user_scalar(DB::LOCK_USER_ROW, tenant, user.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        if locked.is_none() {
            return Ok(false);
        }
        let deleted = self
            .user(
                "DELETE FROM chat_messages WHERE tenant = $1 AND user_id = $2 AND seq = $3",
                tenant,
                user.as_str(),
            )
            .bind(seq)
            .execute(&mut *tx)
            .await?;
        if DB::rows_affected(&deleted) == 0 {
            return Ok(false);
        }
        self.user(
            "UPDATE chat_users SET message_count = message_count - 1, version = version + 1,
                 transcript_digest = NULL
             WHERE tenant = $1 AND user_id = $2",
            tenant,
            user.as_str(),
        )
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
        let mut session = self.reader().await?;
        let row: Option<StatsRow> = self
            .user_rows(STATS, tenant, user.as_str())
            .fetch_optional(session.conn())
            .await?;
        session.done().await?;
        Ok(row.map(|r| UserStats {
            message_count: r.message_count,
            first_seq: r.first_seq,
            last_seq: r.last_seq,
            oldest_at: r.oldest_at,
            newest_at: r.newest_at,
            version: r.version,
        }))
    }

    async fn clear_user(&self, tenant: &Tenant, user: &UserId) -> Result<u64, StoreError> {
        self.clear(tenant, user.as_str()).await
    }

    async fn list_users(
        &self,
        tenant: &Tenant,
        after: Option<&UserId>,
        limit: u32,
    ) -> Result<(Vec<UserSummary>, bool), StoreError> {
        let mut session = self.reader().await?;
        let rows: Vec<(String, i64, Timestamp)> = self
            .user_rows(LIST_USERS, tenant, after.map_or("", UserId::as_str))
            .bind(i64::from(limit) + 1)
            .fetch_all(session.conn())
            .await?;
        session.done().await?;
        users_page(rows, limit)
    }

    async fn dump_users(
        &self,
        tenant: Option<&str>,
        after: Option<(&str, &str)>,
        limit: u32,
    ) -> Result<Vec<UserRecord>, StoreError> {
        let (after_tenant, after_user) = after.unwrap_or(("", ""));
        let mut session = self.reader().await?;
        let users = sqlx::query_as(DUMP_USERS)
            .persistent(self.prepared)
            .bind(tenant.unwrap_or(""))
            .bind(after_tenant)
            .bind(after_user)
            .bind(i64::from(limit))
            .fetch_all(session.conn())
            .await?;
        session.done().await?;
        Ok(users)
    }

    async fn user_record(
        &self,
        tenant: &str,
        user: &str,
    ) -> Result<Option<UserRecord>, StoreError> {
        let tenant = Tenant::new(tenant);
        let mut session = self.reader().await?;
        let record = self
            .user_rows(USER_RECORD, &tenant, user)
            .fetch_optional(session.conn())
            .await?;
        session.done().await?;
        Ok(record)
    }

    async fn dump_messages(
        &self,
        tenant: &str,
        user: &str,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<MessageRecord>, StoreError> {
        let tenant = Tenant::new(tenant);
        let mut session = self.reader().await?;
        let rows = self
            .user_rows(DUMP_MESSAGES, &tenant, user)
            .bind(after_seq)
            .bind(i64::from(limit))
            .fetch_all(session.conn())
            .await?;
        session.done().await?;
        Ok(rows)
    }

    async fn dump_keys(
        &self,
        tenant: &str,
        user: &str,
        after: &str,
        limit: u32,
    ) -> Result<Vec<KeyRecord>, StoreError> {
        let tenant = Tenant::new(tenant);
        let mut session = self.reader().await?;
        let rows = self
            .user_rows(DUMP_KEYS, &tenant, user)
            .bind(after)
            .bind(i64::from(limit))
            .fetch_all(session.conn())
            .await?;
        session.done().await?;
        Ok(rows)
    }

    async fn load_users(&self, rows: &mut dyn UserRows) -> Result<(), StoreError> {
        // Dropped on any error before the commit: nothing of it stays.
        let mut tx = self.write().await?;
        while let Some((tenant, user)) = rows.next_user().await? {
            let tenant = Tenant::new(tenant);
            // The user's row first, as every write locks it before touching
            // its messages; its real values once they are all known.
            self.user(LOAD_USER, &tenant, &user)
                .bind(Timestamp::from_micros(0))
                .execute(&mut *tx)
                .await?;
            loop {
                let batch = rows.messages().await?;
                if batch.is_empty() {
                    break;
                }
                DB::insert_records(&mut tx, self.prepared, &tenant, &user, &batch).await?;
            }
            loop {
                let batch = rows.keys().await?;
                if batch.is_empty() {
                    break;
                }
                for key in batch {
                    self.user(REMEMBER_KEY, &tenant, &user)
                        .bind(key.key)
                        .bind(key.request_digest)
                        .bind(key.first_seq)
                        .bind(key.created_at)
                        .bind(key.version)
                        .bind(key.stored_at)
                        .execute(&mut *tx)
                        .await?;
                }
            }
            let record = rows.user().await?;
            self.user(FINISH_LOAD, &tenant, &user)
                .bind(record.last_seq)
                .bind(record.version)
                .bind(record.message_count)
                .bind(record.last_created_at)
                .bind(record.oldest_at)
                .bind(record.transcript_digest)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn totals(&self) -> Result<(u64, u64), StoreError> {
        let mut session = self.reader().await?;
        let (users, messages): (i64, i64) = sqlx::query_as(TOTALS)
            .persistent(self.prepared)
            .fetch_one(session.conn())
            .await?;
        session.done().await?;
        Ok((row_count(users) as u64, row_count(messages) as u64))
    }

    fn pool_status(&self) -> PoolStatus {
        let mut status = PoolStatus::of(&self.pool);
        if let Some(readers) = &self.readers {
            let readers = readers.status();
            status.in_use += readers.in_use;
            status.idle += readers.idle;
        }
        status
    }

    async fn close(&self) {
        // The batching lanes first, which give back the connections they keep.
        if let Some(batches) = &self.batches {
            batches.commits.close();
            if let Some(pages) = &batches.pages {
                pages.close();
            }
        }
        self.pool.close().await;
        if let Some(readers) = &self.readers {
            readers.close().await;
        }
    }
}

/// What `a` stored, from the counters its append left.
fn stored(a: &Append, counters: Counters) -> Result<crate::domain::Appended, StoreError> {
    let first_seq = counters.last_seq - db_count(a.messages.len()) + 1;
    appended(
        &a.messages,
        first_seq,
        counters.last_created_at,
        counters.version,
    )
}

/// No migrations table yet: the database answers, but is not migrated.
fn is_missing_table(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.code().as_deref() == Some("42P01") || db.message().contains("no such table"))
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
        Timestamp::now().as_micros()
    )
}

/// Takes the lease `$1` for holder `$2` until `$3`, when nobody holds it,
/// when it expired before `$4` (the database's time now), or to renew our own.
const TAKE_LEASE: &str = r#"
INSERT INTO chat_leases (name, holder, expires_at) VALUES ($1, $2, $3)
ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at
WHERE chat_leases.expires_at < $4 OR chat_leases.holder = excluded.holder
"#;

/// Every tenant that has a user row, by a loose index scan of the primary
/// key of `chat_users` (one probe per tenant).
const TENANTS: &str = r#"
WITH RECURSIVE t(tenant) AS (
    SELECT min(tenant) FROM chat_users
    UNION ALL
    SELECT (SELECT min(tenant) FROM chat_users WHERE tenant > t.tenant)
    FROM t WHERE t.tenant IS NOT NULL
)
SELECT tenant FROM t WHERE tenant IS NOT NULL
"#;

/// Locks the user's row, creating it (version 0, no messages, `$3` as its
/// time) if needed, and reads its counters: the first statement of every
/// multi-step write. (On SQLite the write transaction is the lock.)
const LOCK_USER: &str = r#"
INSERT INTO chat_users (tenant, user_id, last_seq, version, message_count, last_created_at)
VALUES ($1, $2, 0, 0, 0, $3)
ON CONFLICT (tenant, user_id) DO UPDATE SET version = chat_users.version
RETURNING last_seq, version, message_count, last_created_at, transcript_digest
"#;

const SEEN_KEY: &str = "SELECT request_digest, first_seq, created_at, version
    FROM chat_idempotency WHERE tenant = $1 AND user_id = $2 AND key = $3";

const REMEMBER_KEY: &str = "INSERT INTO chat_idempotency
    (tenant, user_id, key, request_digest, first_seq, created_at, version, stored_at)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";

/// By key columns rather than `ctid` or `rowid`, which a distributed table
/// (Citus) cannot route.
const DELETE_OLD_KEYS: &str = r#"
DELETE FROM chat_idempotency WHERE (tenant, user_id, key) IN (
    SELECT tenant, user_id, key FROM chat_idempotency WHERE stored_at < $1 LIMIT $2)
"#;

/// The first stored message (its position from 1, and `seq`) that differs
/// from the incoming transcript, whose digests are `$3` laid end to end and
/// whose length is `$4`; none when the stored transcript is a prefix of it.
const FIRST_DIFFERENCE: &str = r#"
SELECT pos, seq FROM (
    SELECT seq, digest, row_number() OVER (ORDER BY seq) AS pos
    FROM chat_messages WHERE tenant = $1 AND user_id = $2) stored
WHERE pos > $4 OR digest <> substr($3, CAST((pos - 1) * 16 + 1 AS integer), 16)
ORDER BY pos LIMIT 1
"#;

/// The counters after a save that appended `$3` messages and now holds `$4`.
const FINISH_SAVE: &str = r#"
UPDATE chat_users SET
    last_seq = last_seq + $3,
    version = version + 1,
    message_count = $4,
    last_created_at = $5,
    oldest_at = (SELECT created_at FROM chat_messages m
                 WHERE m.tenant = chat_users.tenant AND m.user_id = chat_users.user_id
                 ORDER BY seq LIMIT 1),
    transcript_digest = $6
WHERE tenant = $1 AND user_id = $2
RETURNING version
"#;

/// The user's `$3` oldest messages.
const EVICT_OLDEST: &str = r#"
DELETE FROM chat_messages
WHERE tenant = $1 AND user_id = $2 AND seq IN (
    SELECT seq FROM chat_messages WHERE tenant = $1 AND user_id = $2
    ORDER BY seq LIMIT $3)
"#;

const SUBTRACT_EVICTED: &str = "UPDATE chat_users
    SET message_count = message_count - $3, transcript_digest = NULL
    WHERE tenant = $1 AND user_id = $2";

/// Up to `$4` of the user's messages up to `seq` `$3`, oldest first.
const CLEAR_BATCH: &str = r#"
DELETE FROM chat_messages
WHERE tenant = $1 AND user_id = $2 AND seq IN (
    SELECT seq FROM chat_messages WHERE tenant = $1 AND user_id = $2 AND seq <= $3
    ORDER BY seq LIMIT $4)
"#;

const SUBTRACT_CLEARED: &str = r#"
UPDATE chat_users SET version = version + 1, message_count = message_count - $3,
    transcript_digest = NULL,
    oldest_at = (SELECT created_at FROM chat_messages m
                 WHERE m.tenant = $1 AND m.user_id = $2 ORDER BY seq LIMIT 1)
WHERE tenant = $1 AND user_id = $2
"#;

const TRANSCRIPT_HEAD: &str =
    "SELECT version, message_count FROM chat_users WHERE tenant = $1 AND user_id = $2";

const TRANSCRIPT_ROWS: &str =
    "SELECT message FROM chat_messages WHERE tenant = $1 AND user_id = $2 ORDER BY seq";

/// Newest first below `$3`, bounded by the primary key; the age filter is
/// applied to the result, which is a prefix because `created_at` follows `seq`.
pub(super) const PAGE_BACK: &str = r#"
SELECT seq, created_at, message FROM chat_messages
WHERE tenant = $1 AND user_id = $2 AND seq < $3
ORDER BY seq DESC LIMIT $4
"#;

/// The first message of the user `$1`/`$2` whose `seq` is in `seqs` (SQL),
/// as one value: `seq * 2 + 1` when its `created_at` is `$3` or later,
/// `seq * 2` when it is older; NULL when there is none. One value, so that
/// a step of `WINDOW_START` costs one index seek.
macro_rules! probe {
    (seqs: $seqs:expr) => {
        concat!(
            "(SELECT seq * 2 + CASE WHEN created_at >= $3 THEN 1 ELSE 0 END FROM chat_messages\n",
            "        WHERE tenant = $1 AND user_id = $2 AND ",
            $seqs,
            "\n        ORDER BY seq LIMIT 1)"
        )
    };
}

/// `lo` and `hi` after a step of `WINDOW_START` that probed `p`.
macro_rules! next_lo {
    () => {
        "CASE WHEN p % 2 = 0 THEN p / 2 + 1 ELSE lo END"
    };
}
macro_rules! next_hi {
    () => {
        "CASE WHEN p % 2 = 0 THEN hi ELSE (lo + hi) / 2 END"
    };
}

/// Where a forward page of a user's age window starts: the first `seq`
/// after `$4` from which every message's `created_at` is `$3` or later.
/// As `created_at` follows `seq`, the messages in the window are the
/// newest, so a binary search over `seq` by the primary key finds where
/// they start, in at most one step per bit of the user's `last_seq` (an
/// index on `created_at` would cost every append one more B-tree to
/// write). Each step keeps `lo`..`hi` so that the messages below `lo` are
/// older and those from `hi` on are not, and `p`, the probe of the first
/// message from their midpoint: one in the window moves `hi` down to the
/// midpoint (no message lies between them), an older one moves `lo` past
/// it, and none at all moves `hi` down too. The window starts at the last
/// `hi`. No row: no message after `$4` is in the window (`lo` starts past
/// `hi` when `$4` is past `last_seq`, and `hi` never exceeds `last_seq + 1`)
/// or no such user, and there is no page to read.
const WINDOW_START: &str = concat!(
    r#"
WITH RECURSIVE search(lo, hi, p) AS (
    SELECT lo, hi, "#,
    probe!(seqs: "seq >= (lo + hi) / 2 AND seq < hi"),
    r#"
    FROM (SELECT $4 + 1 AS lo, last_seq + 1 AS hi FROM chat_users
          WHERE tenant = $1 AND user_id = $2) first
    UNION ALL
    SELECT "#,
    next_lo!(),
    ",
        ",
    next_hi!(),
    ",
        ",
    probe!(
        seqs: concat!(
            "seq >= (",
            next_lo!(),
            " + ",
            next_hi!(),
            ") / 2 AND seq < ",
            next_hi!()
        )
    ),
    r#"
    FROM search WHERE lo < hi
)
SELECT hi FROM search
WHERE lo >= hi AND hi <= (SELECT last_seq FROM chat_users WHERE tenant = $1 AND user_id = $2)
"#
);

/// Oldest first after `$3`, below `$4`. The window start is found first
/// (`WINDOW_START`): SQLite does not turn a subquery bound into an index range.
pub(super) const PAGE_FORWARD: &str = r#"
SELECT seq, created_at, message FROM chat_messages
WHERE tenant = $1 AND user_id = $2 AND seq > $3 AND seq < $4
ORDER BY seq LIMIT $5
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
    FROM chat_users u WHERE u.tenant = $1 AND u.user_id = $2
) s
WHERE first_seq IS NOT NULL
"#;

/// Users after `$2` (by the bytes of `user_id`), up to `$3`.
const LIST_USERS: &str = r#"
SELECT u.user_id, u.message_count,
    (SELECT created_at FROM chat_messages m WHERE m.tenant = u.tenant AND m.user_id = u.user_id
     ORDER BY seq DESC LIMIT 1) AS newest_at
FROM chat_users u
WHERE u.tenant = $1 AND u.user_id > $2 AND u.message_count > 0
  AND EXISTS (SELECT 1 FROM chat_messages m WHERE m.tenant = u.tenant AND m.user_id = u.user_id)
ORDER BY u.user_id LIMIT $3
"#;

/// Users in `(tenant, user_id)` order after `($2, $3)`, of tenant `$1` (or
/// of every tenant when `$1` is empty), up to `$4`.
const DUMP_USERS: &str = r#"
SELECT tenant, user_id, last_seq, version, message_count, last_created_at, oldest_at,
       transcript_digest
FROM chat_users
WHERE ($1 = '' OR tenant = $1) AND (tenant, user_id) > ($2, $3)
ORDER BY tenant, user_id LIMIT $4
"#;

const USER_RECORD: &str = r#"
SELECT tenant, user_id, last_seq, version, message_count, last_created_at, oldest_at,
       transcript_digest
FROM chat_users WHERE tenant = $1 AND user_id = $2
"#;

const DUMP_MESSAGES: &str = r#"
SELECT seq, created_at, message, digest FROM chat_messages
WHERE tenant = $1 AND user_id = $2 AND seq > $3
ORDER BY seq LIMIT $4
"#;

const DUMP_KEYS: &str = r#"
SELECT key, request_digest, first_seq, created_at, version, stored_at FROM chat_idempotency
WHERE tenant = $1 AND user_id = $2 AND key > $3
ORDER BY key LIMIT $4
"#;

/// A loaded user's row before its messages: fails if the user exists.
const LOAD_USER: &str = "INSERT INTO chat_users
    (tenant, user_id, last_seq, version, message_count, last_created_at)
    VALUES ($1, $2, 0, 0, 0, $3)";

const FINISH_LOAD: &str = r#"
UPDATE chat_users SET last_seq = $3, version = $4, message_count = $5, last_created_at = $6,
    oldest_at = $7, transcript_digest = $8
WHERE tenant = $1 AND user_id = $2
"#;

const TOTALS: &str =
    "SELECT count(*), CAST(coalesce(sum(message_count), 0) AS bigint) FROM chat_users";
