//! A batch of appends folded by user, as a dialect's `append_many` writes
//! it: each user's counters move once, by all of its appends together, and
//! each append is then answered with the counters it would have read had
//! the appends run one after another, in arrival order.

use std::collections::HashMap;

use super::batch::Append;
use super::sql::Counters;
use super::{db_count, StoreError};
use crate::domain::{NewMessage, Timestamp};

/// A user of a batch.
pub struct Folded<'a> {
    pub tenant: &'a str,
    pub user: &'a str,
    /// Messages, and appends, of this user in the batch.
    pub messages: i64,
    pub appends: i64,
    /// The latest time any of its appends was stamped with.
    pub at: Timestamp,
}

/// A message of the batch: its user's slot (in `Fold::users`) and its
/// place, from 1, among that user's messages of the batch.
pub struct Placed<'a> {
    pub slot: usize,
    pub place: i64,
    pub message: &'a NewMessage,
}

/// A user's counters once all of its appends of the batch are written.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Final {
    pub last_seq: i64,
    pub version: i64,
    pub message_count: i64,
    pub last_created_at: Timestamp,
}

pub struct Fold<'a> {
    /// Each user once, in the order of its first append.
    pub users: Vec<Folded<'a>>,
    pub messages: Vec<Placed<'a>>,
    slots: HashMap<(&'a str, &'a str), usize>,
    /// For each append: its user's slot, that user's messages through it,
    /// and its place among that user's appends.
    appends: Vec<(usize, i64, i64)>,
}

impl<'a> Fold<'a> {
    pub fn new(appends: &[&'a Append]) -> Self {
        let mut fold = Fold {
            users: Vec::new(),
            messages: Vec::with_capacity(appends.iter().map(|a| a.messages.len()).sum()),
            slots: HashMap::new(),
            appends: Vec::with_capacity(appends.len()),
        };
        for a in appends {
            let key = (a.tenant.as_str(), a.user.as_str());
            let users = &mut fold.users;
            let slot = *fold.slots.entry(key).or_insert_with(|| {
                users.push(Folded {
                    tenant: key.0,
                    user: key.1,
                    messages: 0,
                    appends: 0,
                    at: a.now,
                });
                users.len() - 1
            });
            let user = &mut fold.users[slot];
            user.appends += 1;
            user.at = user.at.max(a.now);
            for message in &a.messages {
                user.messages += 1;
                fold.messages.push(Placed {
                    slot,
                    place: user.messages,
                    message,
                });
            }
            fold.appends.push((slot, user.messages, user.appends));
        }
        fold
    }

    /// The slot of a user of the batch.
    pub fn slot(&self, tenant: &str, user: &str) -> Option<usize> {
        self.slots.get(&(tenant, user)).copied()
    }

    /// Each append's counters, from each user's counters after the batch
    /// (`finals`, by slot).
    pub fn counters(&self, finals: &[Option<Final>]) -> Result<Vec<Counters>, StoreError> {
        self.appends
            .iter()
            .map(|&(slot, through, place)| {
                let user = &self.users[slot];
                let after = finals.get(slot).and_then(Option::as_ref).ok_or_else(|| {
                    StoreError::Corrupt("a user of the batch was not written".into())
                })?;
                Ok(Counters {
                    last_seq: after.last_seq - user.messages + through,
                    version: after.version - user.appends + place,
                    message_count: after.message_count - user.messages + through,
                    last_created_at: after.last_created_at,
                    transcript_digest: None,
                })
            })
            .collect()
    }

    /// The first `seq` of each user's messages of the batch, by slot.
    pub fn first_seqs(&self, finals: &[Option<Final>]) -> Vec<i64> {
        self.users
            .iter()
            .zip(finals)
            .map(|(user, after)| after.as_ref().map_or(0, |a| a.last_seq - user.messages + 1))
            .collect()
    }
}

/// `slot` as the databases count it, from 1.
pub fn slot_number(slot: usize) -> i64 {
    db_count(slot + 1)
}
