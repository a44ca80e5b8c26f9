//! `chat-history copy`, `export` and `import`: histories moved between real
//! SQLite files and real Postgres databases, checked message by message.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chat_history::domain::{digest16, Idempotency, NewMessage, Tenant, Timestamp, UserId};
use chat_history::store::Store;
use chat_history::transfer::{self, Progress, TransferError};
use serde_json::json;
use sqlx::Connection;

use crate::support::{Backend, TestDb};

const BIG_USER_MESSAGES: usize = 100_000;
const SMALL_USERS: usize = 10_000;

fn message(value: serde_json::Value) -> NewMessage {
    NewMessage::from_value(value, "message").unwrap()
}

async fn append(store: &dyn Store, tenant: &str, user: &str, messages: &[NewMessage]) {
    append_keyed(store, tenant, user, messages, None).await;
}

async fn append_keyed(
    store: &dyn Store,
    tenant: &str,
    user: &str,
    messages: &[NewMessage],
    key: Option<&str>,
) {
    let key = key.map(|k| Idempotency::new(k, [7; 16]).unwrap());
    store
        .append_messages(
            &Tenant::new(tenant),
            &UserId::parse(user).unwrap(),
            messages,
            Timestamp::now(),
            None,
            key.as_ref(),
        )
        .await
        .unwrap();
}

/// The corpus of the round trip, written through the store: tool calls,
/// 30-digit integers, non-BMP user ids, a user that was cleared, keys, two
/// tenants, one user with `BIG_USER_MESSAGES` messages; then `SMALL_USERS`
/// users of two messages each, written in one transaction behind the
/// store's back (10,000 fsyncs would only slow the test down).
async fn corpus(db: &TestDb) -> Arc<dyn Store> {
    let store = db.store().await;
    let tool_call = message(json!({
        "role": "assistant", "content": null,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "lookup", "arguments": "{\"q\": 1}"}}]
    }));
    let big_number = NewMessage::from_raw(
        serde_json::from_str(
            r#"{"role":"tool","tool_call_id":"call_1","content":"ok","n":123456789012345678901234567890}"#,
        )
        .unwrap(),
        "message",
    )
    .unwrap();
    let emoji = message(json!({"role": "user", "content": "🦀 ünïcödé \u{10FFFF}"}));
    append_keyed(
        store.as_ref(),
        "default",
        "😀-user",
        &[tool_call, big_number],
        Some("k1"),
    )
    .await;
    append_keyed(
        store.as_ref(),
        "default",
        "😀-user",
        std::slice::from_ref(&emoji),
        Some("k2"),
    )
    .await;
    append(
        store.as_ref(),
        "other",
        "😀-user",
        std::slice::from_ref(&emoji),
    )
    .await;
    append(
        store.as_ref(),
        "default",
        "cleared",
        std::slice::from_ref(&emoji),
    )
    .await;
    store
        .clear_user(&Tenant::new("default"), &UserId::parse("cleared").unwrap())
        .await
        .unwrap();
    let batch: Vec<NewMessage> = (0..1000)
        .map(|i| message(json!({"role": "user", "content": format!("message {i}")})))
        .collect();
    for _ in 0..BIG_USER_MESSAGES / batch.len() {
        append(store.as_ref(), "default", "big", &batch).await;
    }
    let mut conn = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let at = Timestamp::now().as_micros();
    for i in 0..SMALL_USERS {
        let user = format!("user-{i:05}");
        sqlx::query(
            "INSERT INTO chat_users (tenant, user_id, last_seq, version, message_count,
                 last_created_at, oldest_at) VALUES ('default', $1, 2, 1, 2, $2, $2)",
        )
        .bind(&user)
        .bind(at)
        .execute(&mut *tx)
        .await
        .unwrap();
        for seq in 1..=2_i64 {
            let body = format!(r#"{{"content":"hello {i} {seq}","role":"user"}}"#);
            sqlx::query(
                "INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest)
                 VALUES ('default', $1, $2, $3, $4, $5)",
            )
            .bind(&user)
            .bind(seq)
            .bind(at)
            .bind(&body)
            .bind(digest16(&body).to_vec())
            .execute(&mut *tx)
            .await
            .unwrap();
        }
    }
    tx.commit().await.unwrap();
    store
}

/// Every user of `store`, in key order.
async fn all_users(store: &dyn Store) -> Vec<chat_history::store::UserRecord> {
    let mut users = Vec::new();
    loop {
        let after = users
            .last()
            .map(|u: &chat_history::store::UserRecord| (u.tenant.as_str(), u.user_id.as_str()));
        let page = store.dump_users(None, after, 1000).await.unwrap();
        if page.is_empty() {
            return users;
        }
        users.extend(page);
    }
}

/// Asserts that `a` and `b` hold the same users, each with the same row
/// (`counters`: all of it, else all but `oldest_at`, which an import
/// takes from the first message, and `transcript_digest`, which it does
/// not carry), the same messages, byte for byte, and
/// (`counters`) the same keys. Says how many messages it compared.
async fn assert_same(a: &dyn Store, b: &dyn Store, counters: bool) -> u64 {
    let (users_a, users_b) = (all_users(a).await, all_users(b).await);
    assert_eq!(users_a.len(), users_b.len());
    let mut messages = 0;
    for (ua, ub) in users_a.iter().zip(&users_b) {
        if counters {
            assert_eq!(ua, ub);
        } else {
            let row = |u: &chat_history::store::UserRecord| {
                let counters = (u.last_seq, u.version, u.message_count, u.last_created_at);
                (u.tenant.clone(), u.user_id.clone(), counters)
            };
            assert_eq!(row(ua), row(ub));
        }
        let mut seq = 0;
        loop {
            let ma = a
                .dump_messages(&ua.tenant, &ua.user_id, seq, 5000)
                .await
                .unwrap();
            let mb = b
                .dump_messages(&ua.tenant, &ua.user_id, seq, 5000)
                .await
                .unwrap();
            assert_eq!(
                ma, mb,
                "messages of {:?}/{:?} after {seq}",
                ua.tenant, ua.user_id
            );
            let Some(last) = ma.last() else { break };
            seq = last.seq;
            messages += ma.len() as u64;
        }
        if counters {
            let ka = a
                .dump_keys(&ua.tenant, &ua.user_id, "", 1000)
                .await
                .unwrap();
            let kb = b
                .dump_keys(&ua.tenant, &ua.user_id, "", 1000)
                .await
                .unwrap();
            assert_eq!(ka, kb);
        }
    }
    messages
}

fn rate(messages: u64, started: Instant) -> String {
    format!(
        "{messages} messages in {:.1} s, {:.0} messages/s",
        started.elapsed().as_secs_f64(),
        messages as f64 / started.elapsed().as_secs_f64()
    )
}

/// SQLite → Postgres → SQLite by `copy`, and Postgres → SQLite by export
/// and import: every user, message and key arrives exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_keep_every_message_exactly() {
    let first = TestDb::new(Backend::Sqlite).await;
    let source = corpus(&first).await;
    let (users, messages) = source.totals().await.unwrap();
    assert_eq!(users, SMALL_USERS as u64 + 4);
    let postgres = TestDb::new(Backend::Postgres).await;
    let middle = postgres.store().await;
    let started = Instant::now();
    let summary = transfer::copy(
        source.as_ref(),
        middle.as_ref(),
        false,
        &mut Progress::silent(),
    )
    .await
    .unwrap();
    println!(
        "copy SQLite -> Postgres: {}",
        rate(summary.messages_copied, started)
    );
    assert_eq!(summary.messages_copied, messages);
    assert_eq!(summary.keys_copied, 2);
    assert_eq!(summary.users_verified, users);
    let last = TestDb::new(Backend::Sqlite).await;
    let back = last.store().await;
    let started = Instant::now();
    transfer::copy(
        middle.as_ref(),
        back.as_ref(),
        false,
        &mut Progress::silent(),
    )
    .await
    .unwrap();
    println!("copy Postgres -> SQLite: {}", rate(messages, started));
    assert_eq!(
        assert_same(source.as_ref(), back.as_ref(), true).await,
        messages
    );

    // Export from Postgres, import into a fresh SQLite file.
    let mut file = Vec::new();
    let started = Instant::now();
    let exported = transfer::export(
        middle.as_ref(),
        None,
        None,
        &mut file,
        &mut Progress::silent(),
    )
    .await
    .unwrap();
    println!("export from Postgres: {}", rate(exported.messages, started));
    assert_eq!(exported.messages, messages);
    let text = String::from_utf8(file.clone()).unwrap();
    assert!(text.starts_with("{\"format\":\"chat-history-export\",\"version\":1}\n"));
    assert!(
        text.contains(r#""n":123456789012345678901234567890"#),
        "every digit kept"
    );
    let imported_db = TestDb::new(Backend::Sqlite).await;
    let imported = imported_db.store().await;
    let started = Instant::now();
    let summary = transfer::import(imported.as_ref(), &file[..], false, &mut Progress::silent())
        .await
        .unwrap();
    println!(
        "import into SQLite: {}",
        rate(summary.messages_imported, started)
    );
    assert_eq!(summary.messages_imported, messages);
    assert_eq!(
        assert_same(source.as_ref(), imported.as_ref(), false).await,
        messages
    );
    // The same file again changes nothing, and succeeds.
    let again = transfer::import(imported.as_ref(), &file[..], false, &mut Progress::silent())
        .await
        .unwrap();
    assert_eq!((again.users_imported, again.users_unchanged), (0, users));
    // And exporting what was imported gives the same file back, byte for byte.
    let mut file_again = Vec::new();
    transfer::export(
        imported.as_ref(),
        None,
        None,
        &mut file_again,
        &mut Progress::silent(),
    )
    .await
    .unwrap();
    assert!(
        file_again == file,
        "export -> import -> export is byte for byte the same"
    );
    // One user's whole history, for a data-access request.
    let mut one = Vec::new();
    let summary = transfer::export(
        middle.as_ref(),
        Some("default"),
        Some("😀-user"),
        &mut one,
        &mut Progress::silent(),
    )
    .await
    .unwrap();
    assert_eq!((summary.users, summary.messages), (1, 3));
    assert_eq!(String::from_utf8(one).unwrap().lines().count(), 6);
}

async fn seeded(backend: Backend, users: &[(&str, &str)]) -> (TestDb, Arc<dyn Store>) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    for (user, content) in users {
        append(
            store.as_ref(),
            "default",
            user,
            &[message(json!({"role": "user", "content": content}))],
        )
        .await;
    }
    (db, store)
}

/// A target with users the source lacks is refused without `--merge`; a
/// user in both with other messages is refused even with it; refused
/// copies write nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_refuses_a_target_that_holds_other_data() {
    let (_a, source) = seeded(Backend::Sqlite, &[("alice", "hi"), ("bob", "yo")]).await;
    let (_b, target) = seeded(Backend::Postgres, &[("carol", "hey")]).await;
    let refused = transfer::copy(
        source.as_ref(),
        target.as_ref(),
        false,
        &mut Progress::silent(),
    )
    .await;
    let Err(TransferError::Refused(why)) = refused else {
        panic!("copied into a target that holds other data: {refused:?}")
    };
    assert!(why.contains("--merge") && why.contains("carol"), "{why}");
    assert_eq!(target.totals().await.unwrap(), (1, 1), "nothing was copied");
    let merged = transfer::copy(
        source.as_ref(),
        target.as_ref(),
        true,
        &mut Progress::silent(),
    )
    .await
    .unwrap();
    assert_eq!(merged.users_copied, 2);
    assert_eq!(target.totals().await.unwrap(), (3, 3));

    let (_c, other) = seeded(
        Backend::Sqlite,
        &[("alice", "something else"), ("dave", "x")],
    )
    .await;
    let refused = transfer::copy(
        other.as_ref(),
        target.as_ref(),
        true,
        &mut Progress::silent(),
    )
    .await;
    let Err(TransferError::Refused(why)) = refused else {
        panic!("copied over a user with another history: {refused:?}")
    };
    assert!(why.contains("alice") && why.contains("different"), "{why}");
    assert_eq!(target.totals().await.unwrap(), (3, 3), "nothing was copied");
}

/// `kill -9` in the middle of a copy, then the same command again: it
/// finishes, and every user arrives once, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_copy_finishes_when_run_again() {
    let source_db = TestDb::new(Backend::Sqlite).await;
    let source = corpus(&source_db).await;
    let target_db = TestDb::new(Backend::Postgres).await;
    let target = target_db.store().await;
    let copy = || {
        Command::new(env!("CARGO_BIN_EXE_chat-history"))
            .args(["copy", "--from", &source_db.url, "--to", &target_db.url])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut first = copy();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (users, _) = target.totals().await.unwrap();
        if users >= 1000 {
            break;
        }
        assert!(Instant::now() < deadline, "the copy did not get going");
        assert!(
            first.try_wait().unwrap().is_none(),
            "the copy ended before it was killed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    let (partly, _) = target.totals().await.unwrap();
    let (all, _) = source.totals().await.unwrap();
    assert!(
        partly < all,
        "killed before the end: {partly} of {all} users"
    );
    let second = copy().wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&second.stdout);
    assert!(
        second.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&second.stderr)
    );
    println!("after kill -9 at {partly}/{all} users, the rerun said: {said}");
    assert!(said.contains(&format!("verified {all} users")), "{said}");
    assert_eq!(
        assert_same(source.as_ref(), target.as_ref(), true).await,
        source.totals().await.unwrap().1
    );
}

fn export_file<S: AsRef<str>>(lines: &[S]) -> Vec<u8> {
    let mut text = String::from("{\"format\":\"chat-history-export\",\"version\":1}\n");
    for line in lines {
        text.push_str(line.as_ref());
        text.push('\n');
    }
    text.into_bytes()
}

/// The line after a user's messages: `messages` of them, up to `last_seq`.
fn user_line(user: &str, messages: i64, last_seq: i64) -> String {
    format!(
        r#"{{"tenant":"default","user_id":"{user}","user":{{"last_seq":{last_seq},"version":{last_seq},"message_count":{messages},"last_created_at":"2026-01-01T00:00:0{last_seq}Z"}}}}"#
    )
}

fn end_line(users: u64, messages: u64) -> String {
    format!(r#"{{"end":{{"users":{users},"messages":{messages}}}}}"#)
}

fn line(user: &str, seq: i64, message: &str) -> String {
    format!(
        r#"{{"tenant":"default","user_id":"{user}","seq":{seq},"created_at":"2026-01-01T00:00:0{seq}Z","message":{message}}}"#
    )
}

/// Each kind of bad input is an error naming its line; the user it belongs
/// to gets nothing, the users before it are imported whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_names_the_bad_line_and_leaves_nothing_half_imported() {
    let a1 = line("a", 1, r#"{"role":"user"}"#);
    let a = user_line("a", 1, 1);
    let b1 = line("b", 1, r#"{"role":"user"}"#);
    let b2 = line("b", 2, r#"{"role":"user","content":"x"}"#);
    let cases: Vec<(&str, Vec<u8>, u64, &str)> = vec![
        (
            "unknown version",
            b"{\"format\":\"chat-history-export\",\"version\":2}\n".to_vec(),
            1,
            "format version 2",
        ),
        ("not an export", b"hello\n".to_vec(), 1, "header"),
        (
            "truncated line",
            {
                let mut file = export_file(&[&a1, &a, &b1]);
                file.extend_from_slice(&b2.as_bytes()[..b2.len() - 9]);
                file
            },
            5,
            "cut short",
        ),
        (
            "truncated between lines",
            export_file(&[&a1, &a, &b1, &b2]),
            6,
            "cut short",
        ),
        (
            "invalid message",
            export_file(&[&a1, &a, &b1, &line("b", 2, r#"{"content":"no role"}"#)]),
            5,
            "role",
        ),
        (
            "seq backwards",
            export_file(&[&a1, &a, &b2, &line("b", 1, r#"{"role":"user"}"#)]),
            5,
            "seq 1 does not come after seq 2",
        ),
        (
            "a user's lines apart",
            export_file(&[&a1, &a, &b1, &line("c", 1, r#"{"role":"user"}"#)]),
            5,
            "no user line",
        ),
        (
            "counters that do not fit",
            export_file(&[&a1, &a, &b1, &b2, &user_line("b", 3, 2)]),
            6,
            "says 3 messages",
        ),
    ];
    for (case, file, bad_line, says) in cases {
        let db = TestDb::new(Backend::Sqlite).await;
        let store = db.store().await;
        let result =
            transfer::import(store.as_ref(), &file[..], false, &mut Progress::silent()).await;
        let Err(TransferError::Line { line, message }) = result else {
            panic!("{case}: imported: {result:?}")
        };
        assert_eq!(line, bad_line, "{case}: {message}");
        assert!(message.contains(says), "{case}: {message}");
        let b = store.dump_messages("default", "b", 0, 10).await.unwrap();
        assert!(b.is_empty(), "{case}: half of user b was imported");
        assert!(
            store.user_record("default", "b").await.unwrap().is_none(),
            "{case}"
        );
        let a = store.dump_messages("default", "a", 0, 10).await.unwrap();
        assert_eq!(
            a.len(),
            usize::from(bad_line > 1),
            "{case}: user a is imported whole"
        );
    }
}

/// Without `--merge`, an import into a database that holds other users
/// refuses new users; with it they are added; a user held with other
/// messages is refused either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_takes_the_merge_rule() {
    let (_db, store) = seeded(Backend::Postgres, &[("held", "hi")]).await;
    let file = export_file(&[
        line("new", 1, r#"{"role":"user"}"#),
        user_line("new", 1, 1),
        end_line(1, 1),
    ]);
    let refused = transfer::import(store.as_ref(), &file[..], false, &mut Progress::silent()).await;
    assert!(
        matches!(&refused, Err(TransferError::Line { line: 2, message }) if message.contains("--merge")),
        "{refused:?}"
    );
    assert!(store.user_record("default", "new").await.unwrap().is_none());
    let merged = transfer::import(store.as_ref(), &file[..], true, &mut Progress::silent())
        .await
        .unwrap();
    assert_eq!(merged.users_imported, 1);
    let clash = export_file(&[
        line("held", 1, r#"{"role":"user","content":"other"}"#),
        user_line("held", 1, 1),
        end_line(1, 1),
    ]);
    let refused = transfer::import(store.as_ref(), &clash[..], true, &mut Progress::silent()).await;
    assert!(
        matches!(&refused, Err(TransferError::Line { line: 2, message }) if message.contains("other messages")),
        "{refused:?}"
    );
    assert_eq!(store.totals().await.unwrap(), (2, 2));
}
