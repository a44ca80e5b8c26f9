//! Coalescing. Requests of one kind do not each go to the database on their
//! own: they queue for a task of the store's, which takes every request that
//! queued while its previous batch ran (up to a bound) and serves them
//! together. Appends share one commit (one flush to disk), and history reads
//! one statement. With nothing in flight a request is served at once: an
//! idle service adds no wait, and under load the batches grow by themselves.
//! Every caller is answered after its batch; when the database goes away
//! during it, each of them gets the failure.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::StoreError;
use crate::domain::{Idempotency, NewMessage, Tenant, Timestamp, UserId};

/// One caller's append, as a commit writes it.
#[derive(Debug, Clone)]
pub struct Append {
    pub tenant: Tenant,
    pub user: UserId,
    pub messages: Vec<NewMessage>,
    pub now: Timestamp,
    pub cap: Option<u64>,
    pub idempotency: Option<Idempotency>,
}

impl Append {
    /// Neither a cap nor a key: nothing to read before writing.
    pub fn is_plain(&self) -> bool {
        self.cap.is_none() && self.idempotency.is_none()
    }
}

/// One caller's read of a page backwards: the user's newest `fetch`
/// messages below `seq` `below`, newest first.
#[derive(Debug, Clone)]
pub struct PageBack {
    pub tenant: Tenant,
    pub user: UserId,
    pub below: i64,
    pub fetch: i64,
}

/// How a batch is served: `run` gives an output for each item, in order,
/// or an error when none of them was served (for a commit: nothing of it
/// was stored, or, had the connection been lost during the commit itself,
/// that cannot be known). Each lane keeps an `L` of its own from one batch
/// to the next (a database connection, say).
pub struct Server<I, O, L> {
    /// What the metrics call this kind of batch.
    pub kind: &'static str,
    /// How much of a batch's budget an item takes.
    pub weight: fn(&I) -> usize,
    pub run: Run<I, O, L>,
}

pub type Run<I, O, L> = Box<
    dyn for<'a> Fn(&'a mut L, &'a [I]) -> BoxFuture<'a, Result<Vec<O>, StoreError>> + Send + Sync,
>;

/// `run`, with its signature spelled out for the compiler.
pub fn run_with<I, O, L, F>(run: F) -> Run<I, O, L>
where
    F: for<'a> Fn(&'a mut L, &'a [I]) -> BoxFuture<'a, Result<Vec<O>, StoreError>>
        + Send
        + Sync
        + 'static,
{
    Box::new(run)
}

/// How large a batch may grow (items, and their weight: the first item of
/// a batch is taken whatever its weight), and how many may run at once.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub items: usize,
    pub weight: usize,
    pub lanes: usize,
}

/// Requests waiting for their batch, at most; callers past it wait to queue.
const QUEUE: usize = 4096;

struct Waiting<I, O> {
    item: I,
    answer: oneshot::Sender<Result<O, StoreError>>,
}

/// The queue to a store's batching task. The task ends when the store that
/// holds this is dropped.
pub struct Batcher<I, O> {
    queue: mpsc::Sender<Waiting<I, O>>,
    closed: CancellationToken,
}

impl<I: Send + Sync + 'static, O: Send + 'static> Batcher<I, O> {
    pub fn start<L: Default + Send + 'static>(server: Server<I, O, L>, limits: Limits) -> Self {
        let (queue, waiting) = mpsc::channel(QUEUE);
        let closed = CancellationToken::new();
        tokio::spawn(gather(Arc::new(server), waiting, limits, closed.clone()));
        Self { queue, closed }
    }

    /// Stops taking batches: requests still queued get `Busy`, batches in
    /// flight finish, and every lane then gives its connection back.
    pub fn close(&self) {
        self.closed.cancel();
    }

    /// Queues `item` and waits for the batch that serves it.
    pub async fn submit(&self, item: I) -> Result<O, StoreError> {
        let (answer, answered) = oneshot::channel();
        let gone = || StoreError::Busy("the store is shutting down; retry on another replica");
        self.queue
            .send(Waiting { item, answer })
            .await
            .map_err(|_| gone())?;
        answered.await.map_err(|_| gone())?
    }
}

async fn gather<I: Send + Sync + 'static, O: Send + 'static, L: Default + Send + 'static>(
    server: Arc<Server<I, O, L>>,
    mut waiting: mpsc::Receiver<Waiting<I, O>>,
    limits: Limits,
    closed: CancellationToken,
) {
    // Lanes free to run a batch; a lane comes back when its batch is done.
    let lanes = limits.lanes.max(1);
    let (free, mut idle) = mpsc::channel::<L>(lanes);
    for _ in 0..lanes {
        let _ = free.try_send(L::default());
    }
    let mut next: Option<Waiting<I, O>> = None;
    loop {
        // A lane first: while every lane is busy, requests queue.
        let lane = tokio::select! {
            () = closed.cancelled() => None,
            lane = idle.recv() => lane,
        };
        let Some(mut lane) = lane else {
            return;
        };
        let first = match next.take() {
            Some(first) => first,
            None => {
                let first = tokio::select! {
                    () = closed.cancelled() => None,
                    first = waiting.recv() => first,
                };
                match first {
                    Some(first) => first,
                    None => return,
                }
            }
        };
        let mut weight = (server.weight)(&first.item);
        let (mut items, mut answers) = (vec![first.item], vec![first.answer]);
        while items.len() < limits.items {
            let Ok(more) = waiting.try_recv() else { break };
            let more_weight = (server.weight)(&more.item);
            if weight + more_weight > limits.weight {
                next = Some(more);
                break;
            }
            weight += more_weight;
            items.push(more.item);
            answers.push(more.answer);
        }
        let (server, free) = (server.clone(), free.clone());
        tokio::spawn(async move {
            let outputs = serve(&server, &mut lane, &items).await;
            for (answer, output) in answers.into_iter().zip(outputs) {
                // A caller that went away (timed out, disconnected) is not told.
                let _ = answer.send(output);
            }
            let _ = free.send(lane).await;
        });
    }
}

/// Runs `items` as one batch. When that fails for a reason other than the
/// database going away (something about one of them), each runs alone, so
/// that only that one fails.
async fn serve<I, O, L>(
    server: &Server<I, O, L>,
    lane: &mut L,
    items: &[I],
) -> Vec<Result<O, StoreError>> {
    metrics::counter!("chat_history_batches_total", "kind" => server.kind).increment(1);
    metrics::counter!("chat_history_batched_requests_total", "kind" => server.kind)
        .increment(items.len() as u64);
    match run(server, lane, items).await {
        Ok(outputs) => outputs.into_iter().map(Ok).collect(),
        Err(error) if items.len() == 1 => vec![Err(error)],
        Err(error) if !error.is_unavailable() => {
            metrics::counter!("chat_history_batches_split_total", "kind" => server.kind)
                .increment(1);
            tracing::warn!(
                error = ?error,
                kind = server.kind,
                requests = items.len(),
                "a batch failed; serving its requests one by one"
            );
            let mut outputs = Vec::with_capacity(items.len());
            for item in items {
                let alone = run(server, lane, std::slice::from_ref(item)).await;
                outputs.push(alone.and_then(|mut one| one.pop().ok_or_else(no_output)));
            }
            outputs
        }
        Err(error) => {
            let error = Arc::new(error);
            items
                .iter()
                .map(|_| Err(StoreError::Shared(error.clone())))
                .collect()
        }
    }
}

/// `server.run(lane, items)`, with a panic inside it turned into an error
/// for this batch's callers rather than the end of the task, and a count of
/// outputs that matches the batch.
async fn run<I, O, L>(
    server: &Server<I, O, L>,
    lane: &mut L,
    items: &[I],
) -> Result<Vec<O>, StoreError> {
    use futures_util::FutureExt;
    match std::panic::AssertUnwindSafe((server.run)(lane, items))
        .catch_unwind()
        .await
    {
        Ok(Ok(outputs)) if outputs.len() == items.len() => Ok(outputs),
        Ok(Ok(_)) => Err(no_output()),
        Ok(Err(error)) => Err(error),
        Err(_) => Err(StoreError::Corrupt("a batch panicked".into())),
    }
}

fn no_output() -> StoreError {
    StoreError::Corrupt("a batch gave no answer for a request".into())
}
