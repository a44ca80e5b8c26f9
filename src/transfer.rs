//! Moving histories between stores and in and out of files:
//! `chat-history copy`, `export` and `import`.
//!
//! - **copy** reads one store and writes another, user by user, each user in
//!   one transaction of the target, with its row, messages and idempotency
//!   keys exactly as stored. A user already in the target exactly as in the
//!   source was copied by an earlier run, so a run that was killed picks up
//!   where it stopped. At the end every user is read back from both sides and
//!   compared: counters, message count, last `seq`, and a digest of every
//!   message's `seq`, `created_at` and body.
//! - **export** writes NDJSON: a header line with the format's version, then
//!   one line per message, ordered by tenant, user and `seq`, a line with
//!   each user's counters after its messages, and an end line with totals.
//! - **import** reads that back, one user per transaction of the target,
//!   each committed only once its counters line has been read and checked.
//!
//! Both stream in bounded batches: memory does not grow with the data.

use std::collections::VecDeque;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::config::{Config, CopyArgs, ExportArgs, ImportArgs};
use crate::domain::{BodyError, NewMessage, Timestamp, UserId};
use crate::server::StartError;
use crate::store::{
    DatabaseUrl, KeyRecord, MessageRecord, Store, StoreError, UserRecord, UserRows,
};

/// The `format` of an export's header line.
pub const FORMAT: &str = "chat-history-export";
/// The version of the export format this build writes and reads.
pub const FORMAT_VERSION: u64 = 1;

/// Users read per page.
const USERS_PER_PAGE: u32 = 500;
/// Messages read, and written, per batch.
const MESSAGES_PER_BATCH: u32 = 1000;
/// Idempotency keys read per batch.
const KEYS_PER_BATCH: u32 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Refused(String),
    #[error("verification failed: {0}")]
    Mismatch(String),
    #[error("line {line}: {message}")]
    Line { line: u64, message: String },
    #[error("cannot write the export: {0}")]
    Io(#[from] std::io::Error),
}

/// What a copy did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopySummary {
    /// Users written by this run.
    pub users_copied: u64,
    /// Users the target already held exactly (an earlier run copied them).
    pub users_already_there: u64,
    pub messages_copied: u64,
    pub keys_copied: u64,
    /// Users compared on both sides at the end.
    pub users_verified: u64,
}

/// Copies every tenant's users from `from` to `to` (see the module's doc).
/// The target must hold nothing that the source does not, unless `merge`;
/// a user that both hold differently is refused either way, before anything
/// is written.
pub async fn copy(
    from: &dyn Store,
    to: &dyn Store,
    merge: bool,
    progress: &mut Progress,
) -> Result<CopySummary, TransferError> {
    preflight(from, to, merge).await?;
    let (_, total_messages) = from.totals().await?;
    progress.start("copy", Some(total_messages));
    let mut summary = CopySummary::default();
    let mut after: Option<(String, String)> = None;
    loop {
        let after_key = after.as_ref().map(|(t, u)| (t.as_str(), u.as_str()));
        let users = from.dump_users(None, after_key, USERS_PER_PAGE).await?;
        let Some(last) = users.last() else { break };
        after = Some((last.tenant.clone(), last.user_id.clone()));
        let mut pending = VecDeque::new();
        for user in users {
            let present = to.user_record(&user.tenant, &user.user_id).await?;
            if present.as_ref() == Some(&user) {
                summary.users_already_there += 1;
                progress.add(count(user.message_count));
            } else if present.is_some() {
                return Err(TransferError::Refused(format!(
                    "{} changed in the target while copying; nothing more was copied",
                    name(&user.tenant, &user.user_id)
                )));
            } else {
                pending.push_back(user);
            }
        }
        while !pending.is_empty() {
            let mut rows = StoreRows::new(from, &mut pending, &mut *progress);
            to.load_users(&mut rows).await?;
            summary.messages_copied += rows.messages;
            summary.keys_copied += rows.keys;
            summary.users_copied += rows.users;
        }
    }
    progress.finish();
    summary.users_verified = verify(from, to, progress).await?;
    Ok(summary)
}

/// Refuses a target that holds users the source does not have (unless
/// `merge`), or any user that both hold with different histories.
async fn preflight(from: &dyn Store, to: &dyn Store, merge: bool) -> Result<(), TransferError> {
    let mut after: Option<(String, String)> = None;
    loop {
        let after_key = after.as_ref().map(|(t, u)| (t.as_str(), u.as_str()));
        let users = to.dump_users(None, after_key, USERS_PER_PAGE).await?;
        let Some(last) = users.last() else {
            return Ok(());
        };
        after = Some((last.tenant.clone(), last.user_id.clone()));
        for user in users {
            match from.user_record(&user.tenant, &user.user_id).await? {
                Some(source) if source == user => {}
                Some(_) => {
                    return Err(TransferError::Refused(format!(
                        "{} exists in both stores with different histories; nothing was copied",
                        name(&user.tenant, &user.user_id)
                    )))
                }
                None if merge => {}
                None => {
                    return Err(TransferError::Refused(format!(
                        "the target already holds data that is not in the source ({}, among \
                         others perhaps); nothing was copied. Pass --merge to copy into it \
                         anyway: that works while no (tenant, user) is in both",
                        name(&user.tenant, &user.user_id)
                    )))
                }
            }
        }
    }
}

/// Compares every user of `from` with the same user in `to`; says how many.
async fn verify(
    from: &dyn Store,
    to: &dyn Store,
    progress: &mut Progress,
) -> Result<u64, TransferError> {
    let (users_total, _) = from.totals().await?;
    progress.start("verify", Some(users_total));
    let mut verified = 0;
    let mut after: Option<(String, String)> = None;
    loop {
        let after_key = after.as_ref().map(|(t, u)| (t.as_str(), u.as_str()));
        let users = from.dump_users(None, after_key, USERS_PER_PAGE).await?;
        let Some(last) = users.last() else { break };
        after = Some((last.tenant.clone(), last.user_id.clone()));
        for user in users {
            let who = name(&user.tenant, &user.user_id);
            let target = to.user_record(&user.tenant, &user.user_id).await?;
            if target.as_ref() != Some(&user) {
                return Err(TransferError::Mismatch(format!(
                    "{who}: the counters differ (source {user:?}, target {target:?})"
                )));
            }
            let source = UserDigest::of(from, &user.tenant, &user.user_id).await?;
            let copied = UserDigest::of(to, &user.tenant, &user.user_id).await?;
            if source != copied {
                return Err(TransferError::Mismatch(format!(
                    "{who}: source has {source}, target has {copied}"
                )));
            }
            if source.count != count(user.message_count) {
                return Err(TransferError::Mismatch(format!(
                    "{who}: {} messages stored, but its count says {}",
                    source.count, user.message_count
                )));
            }
            verified += 1;
            progress.add(1);
        }
    }
    progress.finish();
    Ok(verified)
}

/// Users of another store as [`Store::load_users`] asks for them, a batch
/// at a time: small users share a transaction of the target (up to
/// `USERS_PER_LOAD` users or `MESSAGES_PER_LOAD` messages), so that a
/// million small users do not cost a million commits; each user is still
/// written whole or not at all.
struct StoreRows<'a> {
    from: &'a dyn Store,
    pending: &'a mut VecDeque<UserRecord>,
    progress: &'a mut Progress,
    user: Option<UserRecord>,
    after_seq: i64,
    after_key: String,
    messages_done: bool,
    keys_done: bool,
    /// Messages of the current user read so far.
    user_messages: i64,
    users: u64,
    messages: u64,
    keys: u64,
}

/// Users per transaction of a copy's target, at most.
const USERS_PER_LOAD: u64 = 200;
/// Messages per transaction of a copy's target, past which no more users join it.
const MESSAGES_PER_LOAD: u64 = 20_000;

impl<'a> StoreRows<'a> {
    fn new(
        from: &'a dyn Store,
        pending: &'a mut VecDeque<UserRecord>,
        progress: &'a mut Progress,
    ) -> Self {
        Self {
            from,
            pending,
            progress,
            user: None,
            after_seq: 0,
            after_key: String::new(),
            messages_done: false,
            keys_done: false,
            user_messages: 0,
            users: 0,
            messages: 0,
            keys: 0,
        }
    }

    fn current(&self) -> Result<&UserRecord, StoreError> {
        self.user
            .as_ref()
            .ok_or_else(|| StoreError::Input("rows asked for before a user".into()))
    }
}

#[async_trait]
impl UserRows for StoreRows<'_> {
    async fn next_user(&mut self) -> Result<Option<(String, String)>, StoreError> {
        let full = self.users >= USERS_PER_LOAD || self.messages >= MESSAGES_PER_LOAD;
        if self.users > 0 && full {
            return Ok(None);
        }
        let Some(user) = self.pending.pop_front() else {
            return Ok(None);
        };
        let key = (user.tenant.clone(), user.user_id.clone());
        (self.after_seq, self.messages_done, self.keys_done) = (0, false, false);
        self.user_messages = 0;
        self.after_key.clear();
        self.user = Some(user);
        self.users += 1;
        Ok(Some(key))
    }

    async fn messages(&mut self) -> Result<Vec<MessageRecord>, StoreError> {
        if self.messages_done {
            return Ok(Vec::new());
        }
        let user = self.current()?;
        let batch = self
            .from
            .dump_messages(
                &user.tenant,
                &user.user_id,
                self.after_seq,
                MESSAGES_PER_BATCH,
            )
            .await?;
        self.messages_done = batch.len() < MESSAGES_PER_BATCH as usize;
        if let Some(last) = batch.last() {
            self.after_seq = last.seq;
        }
        self.messages += batch.len() as u64;
        self.user_messages += i64::try_from(batch.len()).unwrap_or(i64::MAX);
        self.progress.add(batch.len() as u64);
        Ok(batch)
    }

    async fn keys(&mut self) -> Result<Vec<KeyRecord>, StoreError> {
        if self.keys_done {
            return Ok(Vec::new());
        }
        let user = self.current()?;
        let batch = self
            .from
            .dump_keys(&user.tenant, &user.user_id, &self.after_key, KEYS_PER_BATCH)
            .await?;
        self.keys_done = batch.len() < KEYS_PER_BATCH as usize;
        if let Some(last) = batch.last() {
            self.after_key.clone_from(&last.key);
        }
        self.keys += batch.len() as u64;
        Ok(batch)
    }

    /// The row read with the page of users, if the source still holds it
    /// and it agrees with the messages read since: a user that changed
    /// meanwhile fails the copy (and its target transaction) rather than
    /// arrive with counters that do not fit its messages.
    async fn user(&mut self) -> Result<UserRecord, StoreError> {
        let user = self.current()?.clone();
        let now = self.from.user_record(&user.tenant, &user.user_id).await?;
        let fits = user.message_count == self.user_messages && self.after_seq <= user.last_seq;
        if now.as_ref() != Some(&user) || !fits {
            return Err(StoreError::Input(format!(
                "{} changed in the source while it was copied; stop what writes to the source \
                 and run the copy again (what was copied stays, and is skipped)",
                name(&user.tenant, &user.user_id)
            )));
        }
        Ok(user)
    }
}

/// What a user's messages come to: how many, the last `seq`, and a SHA-256
/// over every message's `seq`, `created_at` and body, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct UserDigest {
    count: u64,
    last_seq: i64,
    sha256: [u8; 32],
}

impl UserDigest {
    async fn of(store: &dyn Store, tenant: &str, user: &str) -> Result<Self, StoreError> {
        let mut hasher = Hasher::new();
        let mut after = 0;
        loop {
            let batch = store
                .dump_messages(tenant, user, after, MESSAGES_PER_BATCH)
                .await?;
            for row in &batch {
                hasher.add(row.seq, row.created_at, &row.message);
            }
            match batch.last() {
                Some(last) if batch.len() == MESSAGES_PER_BATCH as usize => after = last.seq,
                _ => return Ok(hasher.digest()),
            }
        }
    }
}

impl std::fmt::Display for UserDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex: String = self.sha256[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        write!(
            f,
            "{} messages up to seq {}, digest {hex}…",
            self.count, self.last_seq
        )
    }
}

struct Hasher {
    count: u64,
    last_seq: i64,
    sha: Sha256,
}

impl Hasher {
    fn new() -> Self {
        Self {
            count: 0,
            last_seq: 0,
            sha: Sha256::new(),
        }
    }

    fn add(&mut self, seq: i64, created_at: Timestamp, message: &str) {
        self.count += 1;
        self.last_seq = seq;
        self.sha.update(seq.to_be_bytes());
        self.sha.update(created_at.as_micros().to_be_bytes());
        self.sha.update((message.len() as u64).to_be_bytes());
        self.sha.update(message.as_bytes());
    }

    fn digest(self) -> UserDigest {
        UserDigest {
            count: self.count,
            last_seq: self.last_seq,
            sha256: self.sha.finalize().into(),
        }
    }
}

/// What an export wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportSummary {
    pub users: u64,
    pub messages: u64,
}

/// The counters an export carries for each user, on the line after its
/// messages, so that an import keeps them (`seq` and `version` never
/// repeat) and knows the user is complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct UserLine {
    last_seq: i64,
    version: i64,
    message_count: i64,
    last_created_at: Timestamp,
}

/// The last line of an export: without it, the file was cut short.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct EndLine {
    users: u64,
    messages: u64,
}

/// Writes the header line; then for every user of `tenant` (or of every
/// tenant), or for one `user` of it: a line per message, then a line with
/// the user's counters; then the end line with the totals.
pub async fn export(
    store: &dyn Store,
    tenant: Option<&str>,
    user: Option<&str>,
    out: &mut dyn Write,
    progress: &mut Progress,
) -> Result<ExportSummary, TransferError> {
    writeln!(out, r#"{{"format":"{FORMAT}","version":{FORMAT_VERSION}}}"#)?;
    let mut summary = ExportSummary::default();
    let users = match (tenant, user) {
        (Some(tenant), Some(user)) => store.user_record(tenant, user).await?.into_iter().collect(),
        _ => Vec::new(),
    };
    let total = match user {
        Some(_) => users.iter().map(|u| count(u.message_count)).sum(),
        None => store.totals().await?.1,
    };
    progress.start("export", Some(total));
    let mut page = users;
    let mut after: Option<(String, String)> = None;
    loop {
        if user.is_none() {
            let after_key = after.as_ref().map(|(t, u)| (t.as_str(), u.as_str()));
            page = store.dump_users(tenant, after_key, USERS_PER_PAGE).await?;
        }
        let Some(last) = page.last() else { break };
        after = Some((last.tenant.clone(), last.user_id.clone()));
        for record in &page {
            let who = format!(
                r#""tenant":{},"user_id":{}"#,
                serde_json::to_string(&record.tenant).unwrap_or_default(),
                serde_json::to_string(&record.user_id).unwrap_or_default(),
            );
            let mut after_seq = 0;
            loop {
                let batch = store
                    .dump_messages(
                        &record.tenant,
                        &record.user_id,
                        after_seq,
                        MESSAGES_PER_BATCH,
                    )
                    .await?;
                for row in &batch {
                    writeln!(
                        out,
                        r#"{{{who},"seq":{},"created_at":"{}","message":{}}}"#,
                        row.seq, row.created_at, row.message
                    )?;
                }
                summary.messages += batch.len() as u64;
                progress.add(batch.len() as u64);
                match batch.last() {
                    Some(last) if batch.len() == MESSAGES_PER_BATCH as usize => {
                        after_seq = last.seq;
                    }
                    _ => break,
                }
            }
            let counters = UserLine {
                last_seq: record.last_seq,
                version: record.version,
                message_count: record.message_count,
                last_created_at: record.last_created_at,
            };
            let counters = serde_json::to_string(&counters).unwrap_or_default();
            writeln!(out, r#"{{{who},"user":{counters}}}"#)?;
            summary.users += 1;
        }
        if user.is_some() {
            break;
        }
    }
    let end = EndLine {
        users: summary.users,
        messages: summary.messages,
    };
    writeln!(
        out,
        r#"{{"end":{}}}"#,
        serde_json::to_string(&end).unwrap_or_default()
    )?;
    out.flush()?;
    progress.finish();
    Ok(summary)
}

/// What an import did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportSummary {
    pub users_imported: u64,
    /// Users the target already held with exactly these messages.
    pub users_unchanged: u64,
    pub messages_imported: u64,
}

/// Any line of an export after the header, before it is told apart.
#[derive(Deserialize)]
struct Line<'a> {
    tenant: Option<String>,
    user_id: Option<String>,
    seq: Option<i64>,
    created_at: Option<String>,
    #[serde(borrow)]
    message: Option<&'a RawValue>,
    user: Option<UserLine>,
    end: Option<EndLine>,
}

#[derive(Deserialize)]
struct Header {
    format: String,
    version: u64,
}

/// A line of an export, checked on its own.
enum Item {
    Message(MessageRecord),
    User(UserLine),
    End(EndLine),
}

struct Parsed {
    line: u64,
    tenant: String,
    user_id: String,
    item: Item,
}

/// The lines of an export, one at a time, each checked on its own.
struct Lines<R> {
    input: R,
    number: u64,
    buffer: String,
    /// A line read ahead: the next user's first, or the end line.
    pending: Option<Parsed>,
}

impl<R: BufRead> Lines<R> {
    fn line_error(&self, message: impl Into<String>) -> TransferError {
        TransferError::Line {
            line: self.number,
            message: message.into(),
        }
    }

    /// The next line's text, or `None` at the end of the input.
    fn read(&mut self) -> Result<Option<&str>, TransferError> {
        self.buffer.clear();
        let read = self
            .input
            .read_line(&mut self.buffer)
            .map_err(|e| TransferError::Line {
                line: self.number + 1,
                message: format!("cannot be read: {e}"),
            })?;
        if read == 0 {
            return Ok(None);
        }
        self.number += 1;
        Ok(Some(self.buffer.trim_end_matches(['\n', '\r'])))
    }

    fn header(&mut self) -> Result<(), TransferError> {
        let Some(text) = self.read()? else {
            return Err(
                self.line_error("the input is empty; an export starts with its header line")
            );
        };
        let header: Header = serde_json::from_str(text).map_err(|_| {
            self.line_error(format!(
                "not a header line; an export starts with {{\"format\":\"{FORMAT}\",\"version\":{FORMAT_VERSION}}}"
            ))
        })?;
        if header.format != FORMAT {
            return Err(
                self.line_error(format!("the format is {:?}, not {FORMAT:?}", header.format))
            );
        }
        if header.version != FORMAT_VERSION {
            return Err(self.line_error(format!(
                "format version {} is not one this build reads (it reads version {FORMAT_VERSION})",
                header.version
            )));
        }
        Ok(())
    }

    /// The next line, checked on its own. The input ending is an error:
    /// an export ends with its end line, which is never read past.
    fn next(&mut self) -> Result<Parsed, TransferError> {
        if let Some(parsed) = self.pending.take() {
            return Ok(parsed);
        }
        let number = self.number + 1;
        let Some(text) = self.read()? else {
            return Err(TransferError::Line {
                line: number,
                message: "the input ends before the export's end line: it was cut short".into(),
            });
        };
        let bad = |message: String| TransferError::Line {
            line: number,
            message,
        };
        let line: Line = serde_json::from_str(text).map_err(|e| {
            bad(if e.is_eof() {
                "the line is cut short (a truncated file?)".into()
            } else {
                format!("not a line of an export: {e}")
            })
        })?;
        if let Some(end) = line.end {
            return Ok(Parsed {
                line: number,
                tenant: String::new(),
                user_id: String::new(),
                item: Item::End(end),
            });
        }
        let (Some(tenant), Some(user_id)) = (line.tenant, line.user_id) else {
            return Err(bad(
                "a line of an export names its tenant and user_id".into()
            ));
        };
        if tenant.is_empty() {
            return Err(bad("tenant must not be empty".into()));
        }
        UserId::parse(user_id.as_str()).map_err(|e| bad(e.0))?;
        let item = match (line.user, line.seq, line.created_at, line.message) {
            (Some(user), None, None, None) => Item::User(user),
            (None, Some(seq), Some(created_at), Some(message)) => {
                if seq < 1 {
                    return Err(bad(format!("seq must be at least 1; got {seq}")));
                }
                let created_at =
                    chrono::DateTime::parse_from_rfc3339(&created_at).map_err(|e| {
                        bad(format!(
                            "created_at {created_at:?} is not an RFC 3339 time: {e}"
                        ))
                    })?;
                let message = NewMessage::from_raw(message, "message").map_err(|e| {
                    bad(match e {
                        BodyError::Malformed(text) => text,
                        BodyError::Invalid(invalid) => invalid.0,
                        BodyError::TooMany(n) => format!("{n} messages where one was expected"),
                    })
                })?;
                Item::Message(MessageRecord {
                    seq,
                    created_at: Timestamp::from_datetime(created_at.to_utc()),
                    digest: message.digest().to_vec(),
                    message: message.body().to_owned(),
                })
            }
            _ => {
                return Err(bad(
                    "neither a message line (seq, created_at, message) nor a user line (user)"
                        .into(),
                ))
            }
        };
        Ok(Parsed {
            line: number,
            tenant,
            user_id,
            item,
        })
    }
}

/// One user's lines of an import, as [`Store::load_users`] asks for them:
/// its messages, each checked against the one before, up to its user line.
struct ImportRows<'a, R> {
    lines: &'a mut Lines<R>,
    tenant: String,
    user_id: String,
    hasher: Hasher,
    first_created_at: Option<Timestamp>,
    last_created_at: Timestamp,
    /// The user line, once read, and its number.
    counters: Option<(u64, UserLine)>,
    progress: &'a mut Progress,
    started: bool,
}

impl<R: BufRead + Send> ImportRows<'_, R> {
    /// The user's next message; `None` once its user line has been read.
    fn next(&mut self) -> Result<Option<MessageRecord>, TransferError> {
        if self.counters.is_some() {
            return Ok(None);
        }
        let parsed = self.lines.next()?;
        let same = (parsed.tenant.as_str(), parsed.user_id.as_str())
            == (self.tenant.as_str(), self.user_id.as_str());
        let record = match parsed.item {
            Item::Message(record) if same => record,
            Item::User(counters) if same => {
                self.counters = Some((parsed.line, counters));
                return Ok(None);
            }
            _ => {
                return Err(TransferError::Line {
                    line: parsed.line,
                    message: format!(
                        "{} has no user line after its messages: the file is not an export, or \
                         its lines were reordered",
                        name(&self.tenant, &self.user_id)
                    ),
                })
            }
        };
        if self.hasher.count > 0 && record.seq <= self.hasher.last_seq {
            return Err(TransferError::Line {
                line: parsed.line,
                message: format!(
                    "seq {} does not come after seq {} of the line before",
                    record.seq, self.hasher.last_seq
                ),
            });
        }
        if record.created_at < self.last_created_at {
            return Err(TransferError::Line {
                line: parsed.line,
                message: format!(
                    "created_at {} is before {} of the line before: within one user, later seqs \
                     are never older",
                    record.created_at, self.last_created_at
                ),
            });
        }
        self.hasher
            .add(record.seq, record.created_at, &record.message);
        self.first_created_at.get_or_insert(record.created_at);
        self.last_created_at = record.created_at;
        self.progress.add(1);
        Ok(Some(record))
    }

    /// Reads the rest of the user's lines, keeping none of them.
    fn skip_rest(&mut self) -> Result<(), TransferError> {
        while self.next()?.is_some() {}
        Ok(())
    }

    /// The user's row, from its user line, which must agree with its messages.
    fn record(&self) -> Result<UserRecord, TransferError> {
        let Some((line, counters)) = self.counters else {
            return Err(TransferError::Line {
                line: self.lines.number,
                message: "the user's row was asked for before its user line".into(),
            });
        };
        let bad = |message: String| TransferError::Line { line, message };
        if counters.message_count != i64::try_from(self.hasher.count).unwrap_or(i64::MAX) {
            return Err(bad(format!(
                "the user line says {} messages; {} came before it",
                counters.message_count, self.hasher.count
            )));
        }
        if counters.last_seq < self.hasher.last_seq || counters.version < 1 {
            return Err(bad(format!(
                "the user line's last_seq {} and version {} cannot follow seq {}",
                counters.last_seq, counters.version, self.hasher.last_seq
            )));
        }
        if counters.last_created_at < self.last_created_at {
            return Err(bad(format!(
                "the user line's last_created_at {} is before its newest message's",
                counters.last_created_at
            )));
        }
        Ok(UserRecord {
            tenant: self.tenant.clone(),
            user_id: self.user_id.clone(),
            last_seq: counters.last_seq,
            version: counters.version,
            message_count: counters.message_count,
            last_created_at: counters.last_created_at,
            oldest_at: self.first_created_at,
            transcript_digest: None,
        })
    }
}

fn input_error(error: TransferError) -> StoreError {
    StoreError::Input(error.to_string())
}

#[async_trait]
impl<R: BufRead + Send> UserRows for ImportRows<'_, R> {
    /// One user per transaction: an import is atomic per user, and a bad
    /// line takes back only its own user.
    async fn next_user(&mut self) -> Result<Option<(String, String)>, StoreError> {
        if std::mem::replace(&mut self.started, true) {
            return Ok(None);
        }
        Ok(Some((self.tenant.clone(), self.user_id.clone())))
    }

    async fn messages(&mut self) -> Result<Vec<MessageRecord>, StoreError> {
        let mut batch = Vec::new();
        while batch.len() < MESSAGES_PER_BATCH as usize {
            match self.next().map_err(input_error)? {
                Some(record) => batch.push(record),
                None => break,
            }
        }
        Ok(batch)
    }

    async fn keys(&mut self) -> Result<Vec<KeyRecord>, StoreError> {
        Ok(Vec::new())
    }

    async fn user(&mut self) -> Result<UserRecord, StoreError> {
        self.record().map_err(input_error)
    }
}

/// Imports an export read from `input` (see the module's doc). Without
/// `merge`, a target that holds data only takes users it already holds
/// exactly (so importing a file twice changes nothing); with `merge` it
/// also takes users it does not hold. A user it holds with other messages
/// is refused either way. Stops at the first bad line: the users before it
/// are imported, the user it belongs to is not.
pub async fn import(
    store: &dyn Store,
    input: impl BufRead + Send,
    merge: bool,
    progress: &mut Progress,
) -> Result<ImportSummary, TransferError> {
    let mut lines = Lines {
        input,
        number: 0,
        buffer: String::new(),
        pending: None,
    };
    lines.header()?;
    let target_had_data = !store.dump_users(None, None, 1).await?.is_empty();
    progress.start("import", None);
    let mut summary = ImportSummary::default();
    let (mut users, mut messages) = (0_u64, 0_u64);
    let mut previous: Option<(String, String)> = None;
    loop {
        let first = lines.next()?;
        let line = first.line;
        if let Item::End(end) = first.item {
            if end != (EndLine { users, messages }) {
                return Err(TransferError::Line {
                    line,
                    message: format!(
                        "the end line counts {} users and {} messages; the file holds {users} \
                         and {messages}",
                        end.users, end.messages
                    ),
                });
            }
            break;
        }
        let (tenant, user_id) = (first.tenant.clone(), first.user_id.clone());
        if let Some((t, u)) = &previous {
            if (tenant.as_str(), user_id.as_str()) <= (t.as_str(), u.as_str()) {
                return Err(TransferError::Line {
                    line,
                    message: format!(
                        "{} comes after {}: an export lists each user's lines together, in \
                         order of tenant, then user_id (by their bytes)",
                        name(&tenant, &user_id),
                        name(t, u)
                    ),
                });
            }
        }
        previous = Some((tenant.clone(), user_id.clone()));
        lines.pending = Some(first);
        let mut rows = ImportRows {
            lines: &mut lines,
            tenant: tenant.clone(),
            user_id: user_id.clone(),
            hasher: Hasher::new(),
            first_created_at: None,
            last_created_at: Timestamp::from_micros(i64::MIN),
            counters: None,
            progress: &mut *progress,
            started: false,
        };
        if store.user_record(&tenant, &user_id).await?.is_some() {
            rows.skip_rest()?;
            rows.record()?;
            let given = std::mem::replace(&mut rows.hasher, Hasher::new()).digest();
            let held = UserDigest::of(store, &tenant, &user_id).await?;
            if given != held {
                return Err(TransferError::Line {
                    line,
                    message: format!(
                        "{} is already in the target with other messages (the file has {given}, \
                         the target {held}); nothing of it was imported",
                        name(&tenant, &user_id)
                    ),
                });
            }
            users += 1;
            messages += given.count;
            summary.users_unchanged += 1;
            continue;
        }
        if target_had_data && !merge {
            return Err(TransferError::Line {
                line,
                message: format!(
                    "{} is not in the target, which already holds data; pass --merge to add \
                     users to it",
                    name(&tenant, &user_id)
                ),
            });
        }
        match store.load_users(&mut rows).await {
            Ok(()) => {
                users += 1;
                messages += rows.hasher.count;
                summary.users_imported += 1;
                summary.messages_imported += rows.hasher.count;
            }
            Err(StoreError::Input(message)) => {
                // `message` already names its line.
                let (line, message) = split_line(&message);
                return Err(TransferError::Line { line, message });
            }
            Err(other) => return Err(other.into()),
        }
    }
    progress.finish();
    Ok(summary)
}

/// "line N: text" back into its parts.
fn split_line(text: &str) -> (u64, String) {
    text.strip_prefix("line ")
        .and_then(|rest| rest.split_once(": "))
        .and_then(|(n, message)| Some((n.parse().ok()?, message.to_owned())))
        .unwrap_or((0, text.to_owned()))
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// A user as messages name it.
fn name(tenant: &str, user: &str) -> String {
    format!("user {user:?} of tenant {tenant:?}")
}

/// Progress of a long command on stderr: a line redrawn in place on a
/// terminal, a plain line every few seconds otherwise (logs, pipes).
pub struct Progress {
    enabled: bool,
    terminal: bool,
    label: &'static str,
    total: Option<u64>,
    done: u64,
    started: Instant,
    shown: Instant,
}

impl Progress {
    /// Progress on stderr, drawn in place when stderr is a terminal.
    pub fn stderr() -> Self {
        Self::new(true, std::io::stderr().is_terminal())
    }

    /// No progress at all (tests).
    pub fn silent() -> Self {
        Self::new(false, false)
    }

    fn new(enabled: bool, terminal: bool) -> Self {
        let now = Instant::now();
        Self {
            enabled,
            terminal,
            label: "",
            total: None,
            done: 0,
            started: now,
            shown: now,
        }
    }

    fn start(&mut self, label: &'static str, total: Option<u64>) {
        let now = Instant::now();
        (self.label, self.total, self.done, self.started, self.shown) = (label, total, 0, now, now);
    }

    fn add(&mut self, n: u64) {
        self.done += n;
        let every = if self.terminal {
            Duration::from_millis(250)
        } else {
            Duration::from_secs(5)
        };
        if self.shown.elapsed() >= every {
            self.shown = Instant::now();
            self.show(false);
        }
    }

    fn finish(&mut self) {
        self.show(true);
    }

    fn show(&self, last: bool) {
        if !self.enabled {
            return;
        }
        let seconds = self.started.elapsed().as_secs_f64().max(0.001);
        let rate = self.done as f64 / seconds;
        let unit = if self.label == "verify" {
            "users"
        } else {
            "messages"
        };
        let mut text = match self.total {
            Some(total) => format!("{}: {}/{total} {unit}", self.label, self.done),
            None => format!("{}: {} {unit}", self.label, self.done),
        };
        text.push_str(&format!(", {rate:.0} {unit}/s"));
        if last {
            text.push_str(&format!(", done in {seconds:.1} s"));
        } else if let Some(total) = self.total.filter(|_| rate > 0.0) {
            let left = total.saturating_sub(self.done) as f64 / rate;
            text.push_str(&format!(", ETA {left:.0} s"));
        }
        let mut err = std::io::stderr().lock();
        let _ = if self.terminal {
            write!(err, "\r\x1b[2K{text}{}", if last { "\n" } else { "" })
        } else {
            writeln!(err, "{text}")
        };
        let _ = err.flush();
    }
}

/// `chat-history copy`.
pub async fn run_copy(args: CopyArgs, config: Config) -> Result<(), StartError> {
    if args.from.redacted() == args.to.redacted() {
        return Err("--from and --to name the same store".into());
    }
    if let Some(path) = args.from.sqlite_path() {
        if !std::path::Path::new(&path).exists() {
            return Err(format!("--from {}: there is no such SQLite file", args.from).into());
        }
    }
    let from = crate::store::connect(&args.from, config.connect_options())
        .await
        .map_err(|e| format!("--from {}: {}", args.from, crate::error::error_chain(&e)))?;
    if from
        .totals()
        .await
        .map_err(|e| format!("--from {}: {}", args.from, crate::error::error_chain(&e)))?
        .0
        == 0
    {
        return Err(format!("--from {} holds no users: nothing to copy", args.from).into());
    }
    let to = open(&args.to, "--to", &config).await?;
    let started = Instant::now();
    let summary = copy(
        from.as_ref(),
        to.as_ref(),
        args.merge,
        &mut Progress::stderr(),
    )
    .await;
    from.close().await;
    to.close().await;
    let summary = summary?;
    let seconds = started.elapsed().as_secs_f64().max(0.001);
    println!(
        "copied {} users ({} messages, {} idempotency keys) in {seconds:.1} s, {:.0} messages/s; \
         {} users were already there; verified {} users: counts, last seq and message digests match",
        summary.users_copied,
        summary.messages_copied,
        summary.keys_copied,
        summary.messages_copied as f64 / seconds,
        summary.users_already_there,
        summary.users_verified,
    );
    Ok(())
}

/// `chat-history export`.
pub async fn run_export(args: ExportArgs, config: Config) -> Result<(), StartError> {
    let store = open(&config.database_url, "DATABASE_URL", &config).await?;
    let started = Instant::now();
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    let summary = export(
        store.as_ref(),
        args.tenant.as_deref(),
        args.user.as_deref(),
        &mut out,
        &mut Progress::stderr(),
    )
    .await;
    store.close().await;
    let summary = summary?;
    let seconds = started.elapsed().as_secs_f64().max(0.001);
    eprintln!(
        "exported {} users, {} messages in {seconds:.1} s, {:.0} messages/s",
        summary.users,
        summary.messages,
        summary.messages as f64 / seconds
    );
    Ok(())
}

/// `chat-history import`.
pub async fn run_import(args: ImportArgs, config: Config) -> Result<(), StartError> {
    let store = open(&config.database_url, "DATABASE_URL", &config).await?;
    let started = Instant::now();
    let input = std::io::BufReader::with_capacity(1 << 16, std::io::stdin());
    let summary = import(store.as_ref(), input, args.merge, &mut Progress::stderr()).await;
    store.close().await;
    let summary = summary?;
    let seconds = started.elapsed().as_secs_f64().max(0.001);
    eprintln!(
        "imported {} users, {} messages in {seconds:.1} s, {:.0} messages/s; {} users were \
         already there with the same messages",
        summary.users_imported,
        summary.messages_imported,
        summary.messages_imported as f64 / seconds,
        summary.users_unchanged
    );
    Ok(())
}

/// Connects to `url` and brings its schema up to this build's (which adds
/// tables, never changes data).
async fn open(
    url: &DatabaseUrl,
    what: &str,
    config: &Config,
) -> Result<Arc<dyn Store>, StartError> {
    let failed = |e: StoreError| format!("{what} {url}: {}", crate::error::error_chain(&e));
    let store = crate::store::connect(url, config.connect_options())
        .await
        .map_err(failed)?;
    store.migrate().await.map_err(failed)?;
    Ok(store)
}
