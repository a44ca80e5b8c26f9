//! Group commit. Appends do not each run a transaction of their own: they
//! queue for one committer task per store, which takes every append that
//! arrived while its previous commit was in flight and writes them in one
//! transaction, so that many appends share one commit (one fsync). With
//! nothing in flight an append is written at once: an idle service adds no
//! wait. Every caller is answered after the shared commit; when it fails,
//! each of them gets the failure and nothing of the batch is stored.

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

use super::StoreError;
use crate::domain::{AppendOutcome, Idempotency, NewMessage, Tenant, Timestamp, UserId};

/// One caller's append, as the committer writes it.
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

/// What writes a batch: one transaction for all of `batch`, an outcome for
/// each in order, or an error when nothing of it was stored (or, if the
/// connection was lost at the commit, when that cannot be known).
#[async_trait]
pub trait Commit: Send + Sync + 'static {
    async fn commit(&self, batch: &[Append]) -> Result<Vec<AppendOutcome>, StoreError>;
}

/// How large a batch may grow: appends, and messages (the first append of a
/// batch is taken whatever its size).
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    pub appends: usize,
    pub messages: usize,
}

/// Messages in one shared commit, at most (unless one append has more).
pub const BATCH_MESSAGES: usize = 10_000;

/// Appends waiting for the committer, at most; callers past it wait to queue.
const QUEUE: usize = 4096;

struct Waiting {
    append: Append,
    answer: oneshot::Sender<Result<AppendOutcome, StoreError>>,
}

/// The queue to a store's committer task. The task ends when the store
/// that holds this is dropped.
pub struct Committer {
    queue: mpsc::Sender<Waiting>,
}

impl Committer {
    pub fn start(writer: impl Commit, limits: BatchLimits) -> Self {
        let (queue, waiting) = mpsc::channel(QUEUE);
        tokio::spawn(run(writer, waiting, limits));
        Self { queue }
    }

    /// Queues `append` and waits for the commit that writes it.
    pub async fn append(&self, append: Append) -> Result<AppendOutcome, StoreError> {
        let (answer, answered) = oneshot::channel();
        self.queue
            .send(Waiting { append, answer })
            .await
            .map_err(|_| {
                StoreError::Busy("the store is shutting down; retry on another replica")
            })?;
        answered
            .await
            .map_err(|_| StoreError::Busy("the store is shutting down; retry on another replica"))?
    }
}

async fn run(writer: impl Commit, mut waiting: mpsc::Receiver<Waiting>, limits: BatchLimits) {
    let mut batch: Vec<Append> = Vec::new();
    let mut answers = Vec::new();
    let mut next = None;
    loop {
        // Wait for the first append only when none is left over.
        let first = match next.take() {
            Some(first) => first,
            None => match waiting.recv().await {
                Some(first) => first,
                None => return,
            },
        };
        let mut messages = first.append.messages.len();
        batch.push(first.append);
        answers.push(first.answer);
        // Everything that queued meanwhile, up to the limits.
        while batch.len() < limits.appends {
            let Ok(more) = waiting.try_recv() else { break };
            if messages + more.append.messages.len() > limits.messages {
                next = Some(more);
                break;
            }
            messages += more.append.messages.len();
            batch.push(more.append);
            answers.push(more.answer);
        }
        metrics::counter!("chat_history_commits_total").increment(1);
        metrics::counter!("chat_history_committed_appends_total").increment(batch.len() as u64);
        let outcomes = match commit(&writer, &batch).await {
            Ok(outcomes) => outcomes.into_iter().map(Ok).collect(),
            Err(error) if batch.len() == 1 => vec![Err(error)],
            Err(error) if !error.is_unavailable() => {
                // Not the database going away but something about one of
                // them: commit each alone, so that only that one fails.
                tracing::warn!(
                    error = ?error,
                    appends = batch.len(),
                    "a shared commit failed; committing its appends one by one"
                );
                let mut outcomes = Vec::with_capacity(batch.len());
                for append in &batch {
                    outcomes.push(
                        commit(&writer, std::slice::from_ref(append))
                            .await
                            .and_then(|mut one| one.pop().ok_or_else(no_outcome)),
                    );
                }
                outcomes
            }
            Err(error) => {
                let error = Arc::new(error);
                (0..batch.len())
                    .map(|_| Err(StoreError::Shared(error.clone())))
                    .collect()
            }
        };
        for (answer, outcome) in answers.drain(..).zip(outcomes) {
            // A caller that went away (timed out, disconnected) is not told.
            let _ = answer.send(outcome);
        }
        batch.clear();
    }
}

/// `writer.commit(batch)`, with a panic inside it turned into an error for
/// this batch's callers rather than the end of the committer, and a count
/// of outcomes that matches the batch.
async fn commit(writer: &impl Commit, batch: &[Append]) -> Result<Vec<AppendOutcome>, StoreError> {
    use futures_util::FutureExt;
    match std::panic::AssertUnwindSafe(writer.commit(batch))
        .catch_unwind()
        .await
    {
        Ok(Ok(outcomes)) if outcomes.len() == batch.len() => Ok(outcomes),
        Ok(Ok(_)) => Err(no_outcome()),
        Ok(Err(error)) => Err(error),
        Err(_) => Err(StoreError::Corrupt("a commit panicked".into())),
    }
}

fn no_outcome() -> StoreError {
    StoreError::Corrupt("a commit gave no outcome for an append".into())
}
