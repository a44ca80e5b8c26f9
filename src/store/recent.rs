//! Recent pages: each user's newest page as a read last found it, kept with
//! the mark of the history it came from (`version`, the newest message's
//! time, and when the server started). It never answers on its own: a read
//! that it could answer still goes to the database, in its batch's one
//! statement, with the mark it holds; the database reads the messages only
//! when the user's mark is no longer that one. `version` changes on every
//! write that changes a history and never repeats for that user, so an
//! equal mark is the same messages, whichever replica wrote them. What a
//! hit saves is the database reading, sending and the service decoding the
//! rows.
//!
//! An append through this store that took a user from the version kept to
//! the next one puts its messages in front of the kept page: an agent that
//! appends and then reads its window finds it kept.
//!
//! A database that went back in time (a restored backup, a failover to a
//! standby that had not received the last commits) could hand out a version
//! again for other messages. Each of those starts a server, so the mark
//! holds when the server that read it started too: no page read from one
//! server is taken for another's.
//!
//! Bounded by bytes: the pages kept longest and not read since go first (a
//! page read since gets a second chance), and a page over a 256th of the
//! budget is not kept at all, so that the pages held by reads in flight
//! stay within half of it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use super::batch::PageBack;
use super::PageRow;
use crate::domain::{StoredMessage, Tenant, Timestamp, UserId};

/// Which state of a user's history a page was read from, and on which
/// server (when it started).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    pub version: i64,
    pub newest_at: Timestamp,
    pub server_started_at: Timestamp,
}

/// What a read finds kept: the mark to check, and the rows that answer it
/// while the mark holds.
pub struct Kept {
    pub mark: Mark,
    rows: Arc<[PageRow]>,
    complete: bool,
}

impl Kept {
    /// The page `read` asks for, from the kept rows.
    pub fn page(&self, read: &PageBack) -> Vec<PageRow> {
        below(&self.rows, read.below)
            .iter()
            .take(usize::try_from(read.fetch).unwrap_or(0))
            .cloned()
            .collect()
    }

    fn answers(&self, read: &PageBack) -> bool {
        self.complete
            || usize::try_from(read.fetch)
                .is_ok_and(|fetch| below(&self.rows, read.below).len() >= fetch)
    }
}

/// The rows (newest first) with `seq` below `seq`.
fn below(rows: &[PageRow], seq: i64) -> &[PageRow] {
    let from = rows.partition_point(|(s, _, _)| *s >= seq);
    &rows[from..]
}

type Key = (Tenant, UserId);

pub struct RecentPages {
    budget: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    pages: HashMap<Key, Entry>,
    /// Keys in the order their pages were kept, with the `generation` of
    /// that keeping (a key kept again leaves its older place stale).
    order: VecDeque<(Key, u64)>,
    bytes: usize,
    generation: u64,
}

struct Entry {
    kept: Arc<Kept>,
    bytes: usize,
    generation: u64,
    /// Read since it was kept or last passed over for eviction.
    read: bool,
}

/// What a kept page costs beside its bodies: the map's slot, the entry,
/// the queue's places (each with a copy of the key, counted apart), and a
/// row's numbers and allocation.
const ENTRY_BYTES: usize = 384;
const KEY_COPIES: usize = 3;
const ROW_BYTES: usize = 64;

impl RecentPages {
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The kept page that can answer `read`, if any.
    pub fn lookup(&self, read: &PageBack) -> Option<Arc<Kept>> {
        let mut inner = self.lock();
        let entry = inner
            .pages
            .get_mut(&(read.tenant.clone(), read.user.clone()))?;
        if !entry.kept.answers(read) {
            return None;
        }
        entry.read = true;
        Some(entry.kept.clone())
    }

    /// Keeps the page `read` found at `mark`: only a read of the newest
    /// messages (no `before`), whose rows then are the user's newest.
    pub fn keep(&self, read: &PageBack, mark: Mark, rows: &[PageRow]) {
        if read.below != i64::MAX {
            return;
        }
        let key = (read.tenant.clone(), read.user.clone());
        let bytes = self.cost(&key, rows);
        if bytes > self.largest() {
            return;
        }
        let complete = usize::try_from(read.fetch).is_ok_and(|fetch| rows.len() < fetch);
        let kept = Kept {
            mark,
            rows: rows.into(),
            complete,
        };
        let mut inner = self.lock();
        self.insert(&mut inner, key, kept, bytes);
    }

    /// Follows an append of `added` (oldest first) that took the user from
    /// `version - 1` to `version`: the page kept at `version - 1`, with them
    /// in front, is the user's newest at `version` (on the same server: if
    /// it is another by now, the next read sees that). Only for an append
    /// that evicted nothing (no per-user cap).
    pub fn follow_append(
        &self,
        tenant: &Tenant,
        user: &UserId,
        version: i64,
        added: &[StoredMessage],
    ) {
        let Some(newest_at) = added.last().map(|m| m.created_at) else {
            return;
        };
        let key = (tenant.clone(), user.clone());
        let (before, generation) = {
            let inner = self.lock();
            match inner.pages.get(&key) {
                Some(entry) if entry.kept.mark.version.checked_add(1) == Some(version) => {
                    (entry.kept.clone(), entry.generation)
                }
                _ => return,
            }
        };
        // Built outside the lock; kept only if nothing else was meanwhile.
        let mut rows: Vec<PageRow> = added
            .iter()
            .rev()
            .map(|m| (m.seq, m.created_at, m.message.clone()))
            .collect();
        rows.extend(before.rows.iter().cloned());
        if !before.complete {
            // The newest as many as were read: still the newest.
            rows.truncate(before.rows.len().max(added.len()));
        }
        let bytes = self.cost(&key, &rows);
        let mut inner = self.lock();
        let unchanged = inner
            .pages
            .get(&key)
            .is_some_and(|e| e.generation == generation);
        if !unchanged {
            return;
        }
        if bytes > self.largest() {
            if let Some(old) = inner.pages.remove(&key) {
                inner.bytes -= old.bytes;
            }
            return;
        }
        let kept = Kept {
            mark: Mark {
                version,
                newest_at,
                ..before.mark
            },
            rows: rows.into(),
            complete: before.complete,
        };
        self.insert(&mut inner, key, kept, bytes);
    }

    /// The largest page kept.
    fn largest(&self) -> usize {
        self.budget / 256
    }

    fn cost(&self, key: &Key, rows: &[PageRow]) -> usize {
        ENTRY_BYTES
            + KEY_COPIES * (key.0.as_str().len() + key.1.as_str().len())
            + rows
                .iter()
                .map(|r| ROW_BYTES + r.2.get().len())
                .sum::<usize>()
    }

    /// Keeps `kept` for `key` in place of what was kept for it, then drops
    /// pages, oldest first, until all fit in the budget.
    fn insert(&self, inner: &mut Inner, key: Key, kept: Kept, bytes: usize) {
        inner.generation += 1;
        let generation = inner.generation;
        let entry = Entry {
            kept: Arc::new(kept),
            bytes,
            generation,
            read: false,
        };
        if let Some(old) = inner.pages.insert(key.clone(), entry) {
            inner.bytes -= old.bytes;
        }
        inner.bytes += bytes;
        inner.order.push_back((key, generation));
        while inner.bytes > self.budget {
            let Some((key, generation)) = inner.order.pop_front() else {
                break;
            };
            let Some(entry) = inner.pages.get_mut(&key) else {
                continue;
            };
            if entry.generation != generation {
                continue;
            }
            if entry.read {
                // Read since: a second chance, at the back of the queue.
                entry.read = false;
                inner.order.push_back((key, generation));
            } else if let Some(gone) = inner.pages.remove(&key) {
                inner.bytes -= gone.bytes;
            }
        }
        // Stale places (keys kept again since) are dropped once they are
        // half the queue, so that it stays within twice the pages kept.
        if inner.order.len() > 2 * inner.pages.len() + 64 {
            let Inner { pages, order, .. } = inner;
            order.retain(|(key, generation)| {
                pages.get(key).is_some_and(|e| e.generation == *generation)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(user: &str, below: i64, fetch: i64) -> PageBack {
        PageBack {
            tenant: Tenant::default_tenant(),
            user: UserId::parse(user).unwrap(),
            below,
            fetch,
        }
    }

    /// `seqs` newest first, each with a 100-byte body.
    fn rows(seqs: impl Iterator<Item = i64>) -> Vec<PageRow> {
        seqs.map(|s| {
            let text = format!("\"{s:0>98}\"");
            (
                s,
                Timestamp::from_micros(s),
                super::super::body(text).unwrap(),
            )
        })
        .collect()
    }

    fn mark(version: i64) -> Mark {
        Mark {
            version,
            newest_at: Timestamp::from_micros(version),
            server_started_at: Timestamp::from_micros(1),
        }
    }

    fn seqs(page: &[PageRow]) -> Vec<i64> {
        page.iter().map(|r| r.0).collect()
    }

    #[test]
    fn a_kept_page_answers_only_what_it_holds() {
        let recent = RecentPages::new(1 << 20);
        // The newest 21 of 50 messages: not the whole history.
        recent.keep(&read("u", i64::MAX, 21), mark(7), &rows((30..=50).rev()));
        let kept = recent.lookup(&read("u", i64::MAX, 21)).unwrap();
        assert_eq!(kept.mark, mark(7));
        assert_eq!(seqs(&kept.page(&read("u", i64::MAX, 3))), [50, 49, 48]);
        assert_eq!(seqs(&kept.page(&read("u", 45, 3))), [44, 43, 42]);
        assert!(recent.lookup(&read("u", i64::MAX, 22)).is_none());
        assert!(recent.lookup(&read("u", 40, 10)).is_some());
        assert!(recent.lookup(&read("u", 40, 11)).is_none());
        assert!(recent.lookup(&read("v", i64::MAX, 1)).is_none());
        assert!(recent
            .lookup(&PageBack {
                tenant: Tenant::new("other"),
                ..read("u", i64::MAX, 1)
            })
            .is_none());
    }

    #[test]
    fn a_whole_history_answers_any_read() {
        let recent = RecentPages::new(1 << 20);
        recent.keep(&read("u", i64::MAX, 21), mark(3), &rows((1..=5).rev()));
        let kept = recent.lookup(&read("u", i64::MAX, 1000)).unwrap();
        assert_eq!(
            seqs(&kept.page(&read("u", i64::MAX, 1000))),
            [5, 4, 3, 2, 1]
        );
        assert_eq!(seqs(&kept.page(&read("u", 3, 1000))), [2, 1]);
        recent.keep(&read("e", i64::MAX, 21), mark(9), &[]);
        assert!(recent
            .lookup(&read("e", i64::MAX, 5))
            .unwrap()
            .page(&read("e", i64::MAX, 5))
            .is_empty());
    }

    #[test]
    fn only_a_read_of_the_newest_messages_is_kept() {
        let recent = RecentPages::new(1 << 20);
        recent.keep(&read("u", 40, 21), mark(7), &rows((19..=39).rev()));
        assert!(recent.lookup(&read("u", 40, 1)).is_none());
    }

    fn stored(seqs: impl Iterator<Item = i64>) -> Vec<StoredMessage> {
        seqs.map(|s| {
            StoredMessage::new(s, Timestamp::from_micros(100 + s), format!("{{\"n\":{s}}}"))
                .unwrap()
        })
        .collect()
    }

    #[test]
    fn an_append_from_the_version_kept_goes_in_front_of_its_page() {
        let recent = RecentPages::new(1 << 20);
        let (tenant, user) = (Tenant::default_tenant(), UserId::parse("u").unwrap());
        recent.keep(&read("u", i64::MAX, 21), mark(7), &rows((30..=50).rev()));
        // From another version than the one kept: nothing changes.
        recent.follow_append(&tenant, &user, 9, &stored(51..=52));
        assert_eq!(
            recent.lookup(&read("u", i64::MAX, 1)).unwrap().mark,
            mark(7)
        );
        recent.follow_append(&tenant, &user, 8, &stored(51..=52));
        let kept = recent.lookup(&read("u", i64::MAX, 21)).unwrap();
        assert_eq!(
            kept.mark,
            Mark {
                version: 8,
                newest_at: Timestamp::from_micros(152),
                server_started_at: Timestamp::from_micros(1),
            }
        );
        let page = kept.page(&read("u", i64::MAX, 21));
        assert_eq!(seqs(&page), (32..=52).rev().collect::<Vec<_>>());
        assert_eq!(page[0].2.get(), r#"{"n":52}"#);
        // As many rows as were read, no more: the history is not all here.
        assert!(recent.lookup(&read("u", i64::MAX, 22)).is_none());

        // A whole history stays whole.
        recent.keep(&read("w", i64::MAX, 21), mark(2), &rows((1..=2).rev()));
        let w = UserId::parse("w").unwrap();
        recent.follow_append(&tenant, &w, 3, &stored(3..=4));
        let kept = recent.lookup(&read("w", i64::MAX, 1000)).unwrap();
        assert_eq!(seqs(&kept.page(&read("w", i64::MAX, 1000))), [4, 3, 2, 1]);
        // A user with no page kept gets none.
        let x = UserId::parse("x").unwrap();
        recent.follow_append(&tenant, &x, 1, &stored(1..=1));
        assert!(recent.lookup(&read("x", i64::MAX, 1)).is_none());
    }

    #[test]
    fn kept_pages_stay_within_their_budget() {
        // Pages of 21 rows of 100 bytes: about 4 KiB each.
        let budget = 2 << 20;
        let recent = RecentPages::new(budget);
        for round in 0..3 {
            for user in 0..1000 {
                recent.keep(
                    &read(&format!("u{user}"), i64::MAX, 21),
                    mark(round),
                    &rows((1..=21).rev()),
                );
                let inner = recent.inner.lock().unwrap();
                assert!(inner.bytes <= budget, "{} bytes kept", inner.bytes);
                assert!(inner.order.len() <= 2 * inner.pages.len() + 65);
            }
        }
        // The newest stay, the oldest went.
        assert!(recent.lookup(&read("u999", i64::MAX, 21)).is_some());
        assert!(recent.lookup(&read("u0", i64::MAX, 21)).is_none());
        let inner = recent.inner.lock().unwrap();
        assert!(inner.pages.len() > 50, "{} pages kept", inner.pages.len());
    }

    #[test]
    fn a_page_over_a_256th_of_the_budget_is_not_kept() {
        let recent = RecentPages::new(1 << 20);
        recent.keep(&read("big", i64::MAX, 101), mark(1), &rows((1..=100).rev()));
        assert!(recent.lookup(&read("big", i64::MAX, 1)).is_none());
        recent.keep(&read("small", i64::MAX, 21), mark(1), &rows((1..=21).rev()));
        assert!(recent.lookup(&read("small", i64::MAX, 1)).is_some());
    }

    #[test]
    fn a_page_read_since_it_was_kept_outlives_one_that_was_not() {
        // One-row pages of about 600 bytes: room for about 250.
        let recent = RecentPages::new(256 * 600);
        let keep = |user: u32| {
            let read = read(&format!("u{user}"), i64::MAX, 21);
            recent.keep(&read, mark(1), &rows(1..=1));
        };
        (0..200).for_each(keep);
        assert!(recent.lookup(&read("u0", i64::MAX, 21)).is_some());
        (200..400).for_each(keep);
        // "u1", kept after "u0" but never read, went before it.
        assert!(recent.lookup(&read("u1", i64::MAX, 21)).is_none());
        assert!(recent.lookup(&read("u0", i64::MAX, 21)).is_some());
        assert!(recent.lookup(&read("u399", i64::MAX, 21)).is_some());
    }
}
