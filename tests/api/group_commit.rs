//! Group commit: appends that queue while a commit is in flight share the
//! next one (and, on Postgres, reads of the newest messages that queue
//! while two are in flight share one statement). Each test first holds the writer (a row lock on Postgres, the
//! write lock on SQLite) from a connection of its own, so that one commit
//! is stuck while the appends under test queue behind it: they then share
//! one commit, whatever the machine's speed. What each caller is answered,
//! and what is stored, must be what appending them one at a time gives.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use chat_history::domain::{
    AppendOutcome, Appended, Idempotency, NewMessage, Tenant, Timestamp, UserId,
};
use chat_history::store::{ConnectOptions, DatabaseUrl, Store};
use serde_json::{json, Value};
use sqlx::{Connection, Executor};
use tokio::task::JoinSet;

use crate::on_both_backends;
use crate::support::{Backend, Replica, TestApp, TestDb};

on_both_backends!(
    queued_appends_share_a_commit_and_are_answered_as_if_alone,
    queued_reads_each_get_their_own_page,
    a_poisoned_append_fails_alone,
    a_row_in_the_way_fails_its_user_alone_and_leaves_no_part_of_a_batch,
    kill_9_during_coalesced_load_loses_no_acknowledged_message,
);

/// Held by the tests that split commit batches (by making one fail) or
/// check that none was split, so that one does not see the other's.
static SPLITS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Batches of `kind` that failed and were served one request at a time, so
/// far, in this process.
fn splits(kind: &str) -> f64 {
    let name = format!("chat_history_batches_split_total{{kind=\"{kind}\"}} ");
    chat_history::telemetry::metrics()
        .render()
        .lines()
        .filter_map(|line| line.strip_prefix(&name)?.parse::<f64>().ok())
        .sum()
}

/// A connection that holds the writer until `release`: on Postgres the row
/// of user `held` (its appends wait), on SQLite the database's write lock
/// (every write waits).
enum Holder {
    Postgres(sqlx::PgConnection),
    Sqlite(sqlx::SqliteConnection),
}

impl Holder {
    async fn hold(db: &TestDb, store: &dyn Store) -> Self {
        append(store, "held", &[text("before")], None, None).await;
        match db.backend {
            Backend::Postgres => {
                let mut conn = sqlx::PgConnection::connect(&db.direct_url).await.unwrap();
                conn.execute("BEGIN").await.unwrap();
                conn.execute("SELECT 1 FROM chat_users WHERE user_id = 'held' FOR UPDATE")
                    .await
                    .unwrap();
                Self::Postgres(conn)
            }
            Backend::Sqlite => {
                let mut conn = sqlx::SqliteConnection::connect(&db.direct_url)
                    .await
                    .unwrap();
                conn.execute("BEGIN IMMEDIATE").await.unwrap();
                Self::Sqlite(conn)
            }
        }
    }

    async fn release(self) {
        match self {
            Self::Postgres(mut conn) => conn.execute("COMMIT").await.map(|_| ()),
            Self::Sqlite(mut conn) => conn.execute("COMMIT").await.map(|_| ()),
        }
        .unwrap();
    }
}

fn text(content: &str) -> NewMessage {
    NewMessage::from_value(json!({"role": "user", "content": content}), "m").unwrap()
}

async fn append(
    store: &dyn Store,
    user: &str,
    messages: &[NewMessage],
    cap: Option<u64>,
    key: Option<&str>,
) -> AppendOutcome {
    let key = key.map(|k| Idempotency::new(k, [7; 16]).unwrap());
    store
        .append_messages(
            &Tenant::default_tenant(),
            &UserId::parse(user).unwrap(),
            messages,
            Timestamp::now(),
            cap,
            key.as_ref(),
        )
        .await
        .unwrap()
}

/// What one caller asked for, for the checks.
#[derive(Clone)]
struct Asked {
    user: String,
    contents: Vec<String>,
    cap: Option<u64>,
    key: Option<String>,
}

/// Starts the first commit (an append to `held`, which waits for the
/// holder), then every one of `asks` at once; releases the holder once
/// they have all queued, and returns each caller's outcome.
async fn behind_a_held_commit(
    db: &TestDb,
    store: Arc<dyn Store>,
    asks: Vec<Asked>,
) -> Vec<(Asked, Result<AppendOutcome, String>)> {
    let holder = Holder::hold(db, &*store).await;
    let stuck = {
        let store = store.clone();
        tokio::spawn(async move { append(&*store, "held", &[text("stuck")], None, None).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut callers = JoinSet::new();
    for (i, ask) in asks.into_iter().enumerate() {
        let store = store.clone();
        callers.spawn(async move {
            let messages: Vec<NewMessage> = ask.contents.iter().map(|c| text(c)).collect();
            let key = ask
                .key
                .as_deref()
                .map(|k| Idempotency::new(k, [7; 16]).unwrap());
            let outcome = store
                .append_messages(
                    &Tenant::default_tenant(),
                    &UserId::parse(&ask.user).unwrap(),
                    &messages,
                    Timestamp::now(),
                    ask.cap,
                    key.as_ref(),
                )
                .await
                .map_err(|e| format!("{e:?}"));
            (i, ask, outcome)
        });
    }
    // Let every caller queue behind the stuck commit, then free it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    holder.release().await;
    assert!(matches!(stuck.await.unwrap(), AppendOutcome::Stored(_)));
    let mut answered = Vec::new();
    while let Some(done) = callers.join_next().await {
        answered.push(done.unwrap());
    }
    answered.sort_by_key(|(i, _, _)| *i);
    answered.into_iter().map(|(_, a, o)| (a, o)).collect()
}

fn contents(appended: &Appended) -> Vec<String> {
    appended
        .messages
        .iter()
        .map(|m| {
            serde_json::from_str::<Value>(m.message.get()).unwrap()["content"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect()
}

async fn queued_appends_share_a_commit_and_are_answered_as_if_alone(backend: Backend) {
    let _splits = SPLITS.lock().await;
    let split_before = splits("commit");
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    // Round 1: plain appends only (on Postgres one statement for them
    // all), several per user, of one to three messages.
    // Round 2: keys (two callers with the same key at once among them) and
    // a cap, beside plain appends to the same users.
    for round in 1..=2 {
        let mut asks = Vec::new();
        for i in 0..60 {
            let contents = (0..1 + i % 3)
                .map(|j| format!("r{round}-{i}-{j}"))
                .collect();
            // A capped user's appends all carry the cap, as the setting does.
            let (user, cap, key) = match (round, i % 4) {
                (2, 1) => (format!("r2u{}", i % 7), None, Some(format!("k{i}"))),
                (2, 2) => (format!("r2cap{}", i % 3), Some(4), None),
                _ => (format!("r{round}u{}", i % 7), None, None),
            };
            asks.push(Asked {
                user,
                contents,
                cap,
                key,
            });
        }
        if round == 2 {
            let twin = Asked {
                user: "r2twin".into(),
                contents: vec!["twin".into()],
                cap: None,
                key: Some("same".into()),
            };
            asks.push(twin.clone());
            asks.push(twin);
        }
        let answered = behind_a_held_commit(&db, store.clone(), asks).await;

        let mut by_user: BTreeMap<String, Vec<(Asked, Appended)>> = BTreeMap::new();
        let mut replays = Vec::new();
        for (ask, outcome) in answered {
            match outcome.unwrap_or_else(|e| panic!("{}: {e}", ask.user)) {
                AppendOutcome::Stored(appended) => {
                    assert_eq!(contents(&appended), ask.contents, "what was asked");
                    by_user
                        .entry(ask.user.clone())
                        .or_default()
                        .push((ask, appended));
                }
                AppendOutcome::Replayed(appended) => {
                    assert_eq!(ask.user, "r2twin");
                    replays.push(appended);
                }
                AppendOutcome::KeyReused => {
                    panic!("{}: an equal body is never KeyReused", ask.user)
                }
            }
        }
        assert_eq!(
            replays.len(),
            usize::from(round == 2),
            "the twin's second caller replays"
        );
        for replay in replays {
            // The same answer as the caller whose append stored it.
            let first = &by_user["r2twin"][0].1;
            assert_eq!(
                by_user["r2twin"].len(),
                1,
                "the twins' batch is stored once"
            );
            assert_eq!(replay.version, first.version);
            assert_eq!(replay.messages[0].seq, first.messages[0].seq);
            assert_eq!(replay.messages[0].created_at, first.messages[0].created_at);
        }
        for (user, mut appends) in by_user {
            // As if one after another: seqs consecutive within an append,
            // disjoint across them and covering 1..=n; versions 1..=k in the
            // same order; created_at never going back.
            appends.sort_by_key(|(_, a)| a.messages[0].seq);
            let mut next_seq = 1;
            let mut last_at = Timestamp::from_micros(0);
            for (place, (_, appended)) in appends.iter().enumerate() {
                assert_eq!(
                    appended.version,
                    place as i64 + 1,
                    "{user}: versions in seq order"
                );
                for m in &appended.messages {
                    assert_eq!(m.seq, next_seq, "{user}: seqs consecutive");
                    assert!(
                        m.created_at >= last_at,
                        "{user}: created_at never goes back"
                    );
                    next_seq += 1;
                    last_at = m.created_at;
                }
            }
            let stored = next_seq - 1;
            let stats = store
                .user_stats(&Tenant::default_tenant(), &UserId::parse(&user).unwrap())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(stats.last_seq, stored, "{user}");
            assert_eq!(stats.version, appends.len() as i64, "{user}");
            let capped = appends.iter().any(|(ask, _)| ask.cap.is_some());
            if capped {
                assert_eq!(stats.message_count, stored.min(4), "{user}: the cap holds");
                assert_eq!(
                    stats.first_seq,
                    stored - stats.message_count + 1,
                    "{user}: the oldest went"
                );
            } else {
                assert_eq!(
                    stats.message_count, stored,
                    "{user}: every message stored once"
                );
            }
        }
    }
    assert_eq!(
        splits("commit"),
        split_before,
        "no shared commit failed and was split"
    );
}

async fn queued_reads_each_get_their_own_page(backend: Backend) {
    use chat_history::domain::{HistoryPage, HistoryQuery};
    let split_before = splits("read");
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    for user in 0..10 {
        let messages: Vec<NewMessage> = (0..user * 3)
            .map(|i| text(&format!("u{user}-{i}")))
            .collect();
        if !messages.is_empty() {
            append(&*store, &format!("u{user}"), &messages, None, None).await;
        }
    }
    let queries: Vec<(String, HistoryQuery)> = (0..40)
        .map(|i| {
            let query = HistoryQuery {
                limit: 1 + i % 7,
                not_before: None,
                before: (i % 3 == 0).then_some(i64::from(5 + i % 11)),
                after: None,
            };
            (format!("u{}", i % 10), query)
        })
        .collect();
    let read = |store: Arc<dyn Store>, user: String, query: HistoryQuery| async move {
        store
            .history_window(
                &Tenant::default_tenant(),
                &UserId::parse(user).unwrap(),
                query,
            )
            .await
            .unwrap()
    };
    // On Postgres, a lock of the test's own stops every read; those that
    // queue behind the two in flight are then read in one statement.
    let mut held = None;
    if backend == Backend::Postgres {
        let mut conn = sqlx::PgConnection::connect(&db.direct_url).await.unwrap();
        conn.execute("BEGIN").await.unwrap();
        conn.execute("LOCK TABLE chat_messages IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        held = Some(conn);
    }
    let mut readers = JoinSet::new();
    for (i, (user, query)) in queries.iter().cloned().enumerate() {
        let store = store.clone();
        readers.spawn(async move { (i, read(store, user, query).await) });
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    if let Some(mut conn) = held {
        conn.execute("COMMIT").await.unwrap();
    }
    let mut together: Vec<(usize, HistoryPage)> = Vec::new();
    while let Some(done) = readers.join_next().await {
        together.push(done.unwrap());
    }
    together.sort_by_key(|(i, _)| *i);
    let seqs = |page: &HistoryPage| page.messages.iter().map(|m| m.seq).collect::<Vec<_>>();
    for ((i, page), (user, query)) in together.iter().zip(&queries) {
        // The same page read alone, and what it must hold.
        let alone = read(store.clone(), user.clone(), *query).await;
        assert_eq!(seqs(page), seqs(&alone), "read {i} of {user}");
        assert_eq!(page.has_more, alone.has_more, "read {i} of {user}");
        let stored: i64 = user[1..].parse::<i64>().unwrap() * 3;
        let below = query.before.unwrap_or(i64::MAX).min(stored + 1);
        let first = (below - i64::from(query.limit)).max(1);
        assert_eq!(
            seqs(page),
            (first..below).collect::<Vec<_>>(),
            "read {i} of {user}"
        );
        for m in &page.messages {
            let content = serde_json::from_str::<Value>(m.message.get()).unwrap()["content"]
                .as_str()
                .unwrap()
                .to_owned();
            assert_eq!(
                content,
                format!("{user}-{}", m.seq - 1),
                "read {i}: another user's message"
            );
        }
    }
    assert_eq!(
        splits("read"),
        split_before,
        "no shared read failed and was split"
    );
}

async fn a_poisoned_append_fails_alone(backend: Backend) {
    let _splits = SPLITS.lock().await;
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    // A trigger of the test's own refuses one message: an error of one
    // append, not of the database.
    match backend {
        Backend::Postgres => {
            let mut conn = sqlx::PgConnection::connect(&db.direct_url).await.unwrap();
            conn.execute(
                "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN IF NEW.message LIKE '%poison%' THEN RAISE EXCEPTION 'poisoned'; END IF;
                 RETURN NEW; END $$;
                 CREATE TRIGGER poison BEFORE INSERT ON chat_messages
                 FOR EACH ROW EXECUTE FUNCTION poison();",
            )
            .await
            .unwrap();
        }
        Backend::Sqlite => {
            let mut conn = sqlx::SqliteConnection::connect(&db.direct_url)
                .await
                .unwrap();
            conn.execute(
                "CREATE TRIGGER poison BEFORE INSERT ON chat_messages
                 WHEN NEW.message LIKE '%poison%' BEGIN SELECT RAISE(ABORT, 'poisoned'); END;",
            )
            .await
            .unwrap();
        }
    }
    let asks: Vec<Asked> = (0..20)
        .map(|i| Asked {
            user: format!("p{}", i % 5),
            contents: vec![if i == 7 {
                "poison".into()
            } else {
                format!("fine-{i}")
            }],
            cap: None,
            key: None,
        })
        .collect();
    let answered = behind_a_held_commit(&db, store.clone(), asks).await;
    for (ask, outcome) in &answered {
        if ask.contents[0] == "poison" {
            assert!(outcome.is_err(), "the poisoned append fails");
        } else {
            assert!(
                matches!(outcome, Ok(AppendOutcome::Stored(_))),
                "{}: {:?}",
                ask.contents[0],
                outcome.as_ref().err()
            );
        }
    }
    let mut stored = 0;
    for user in 0..5 {
        let stats = store
            .user_stats(
                &Tenant::default_tenant(),
                &UserId::parse(format!("p{user}")).unwrap(),
            )
            .await
            .unwrap();
        stored += stats.map_or(0, |s| s.message_count);
    }
    assert_eq!(
        stored, 19,
        "every append but the poisoned one is stored, once"
    );
}

/// A row already at the `seq` that a user's next append takes (put there
/// by the test, behind the store's back) makes the shared insert fail on
/// its key partway through: on SQLite an `INSERT OR FAIL`, which keeps the
/// rows it inserted before the failure until its transaction is rolled
/// back. Nothing of the failed batch may stay: served again one by one,
/// every other user's appends are stored once, with the `seq`s they would
/// have had alone, and the writer goes on serving.
async fn a_row_in_the_way_fails_its_user_alone_and_leaves_no_part_of_a_batch(backend: Backend) {
    let _splits = SPLITS.lock().await;
    let split_before = splits("commit");
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    let tenant = Tenant::default_tenant();
    let in_the_way = "INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest)
         VALUES ($1, 'p2', 1, $2, '{\"role\":\"user\",\"content\":\"in the way\"}', $3)";
    let count = "SELECT user_id, count(*), count(DISTINCT seq), max(seq) FROM chat_messages
         WHERE user_id LIKE 'p%' GROUP BY user_id ORDER BY user_id";
    // The same steps on either backend's own connection type.
    macro_rules! planted_then_counted {
        ($conn:ty) => {{
            let mut conn = <$conn>::connect(&db.direct_url).await.unwrap();
            sqlx::query(in_the_way)
                .bind(tenant.as_str())
                .bind(Timestamp::now())
                .bind(vec![0u8; 16])
                .execute(&mut conn)
                .await
                .unwrap();
            drop(conn);
            check_in_the_way(behind_a_held_commit(&db, store.clone(), two_each()).await);
            let mut conn = <$conn>::connect(&db.direct_url).await.unwrap();
            sqlx::query_as(count).fetch_all(&mut conn).await.unwrap()
        }};
    }
    let rows: Vec<(String, i64, i64, i64)> = match backend {
        Backend::Postgres => planted_then_counted!(sqlx::PgConnection),
        Backend::Sqlite => planted_then_counted!(sqlx::SqliteConnection),
    };
    // Four appends of two messages to each user but p2, whose one row is
    // the test's.
    let expected: Vec<(String, i64, i64, i64)> = ["p0", "p1", "p2", "p3", "p4"]
        .iter()
        .map(|&user| match user {
            "p2" => (user.to_owned(), 1, 1, 1),
            _ => (user.to_owned(), 8, 8, 8),
        })
        .collect();
    assert_eq!(rows, expected, "(user, rows, distinct seqs, last seq)");
    assert!(
        splits("commit") > split_before,
        "the appends shared a commit, which failed and was served one by one"
    );
    let AppendOutcome::Stored(after) = append(&*store, "p0", &[text("after")], None, None).await
    else {
        panic!("an append after the failed batch is stored");
    };
    assert_eq!(after.messages[0].seq, 9, "p0 goes on after its eight");
}

/// Twenty appends of two messages each, to users p0 to p4 in turn.
fn two_each() -> Vec<Asked> {
    (0..20)
        .map(|i| Asked {
            user: format!("p{}", i % 5),
            contents: vec![format!("a-{i}"), format!("b-{i}")],
            cap: None,
            key: None,
        })
        .collect()
}

/// p2's appends fail (its first `seq` is taken); every other is stored with
/// `seq`s as if alone: two consecutive ones each, a user's four appends
/// together taking 1 to 8.
fn check_in_the_way(answered: Vec<(Asked, Result<AppendOutcome, String>)>) {
    let mut seqs: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (ask, outcome) in &answered {
        if ask.user == "p2" {
            assert!(outcome.is_err(), "{}: {:?}", ask.contents[0], outcome);
            continue;
        }
        let Ok(AppendOutcome::Stored(stored)) = outcome else {
            panic!("{}: {:?}", ask.contents[0], outcome);
        };
        assert_eq!(contents(stored), ask.contents);
        let mine: Vec<i64> = stored.messages.iter().map(|m| m.seq).collect();
        assert_eq!(mine.len(), 2, "{}", ask.contents[0]);
        assert_eq!(mine[1], mine[0] + 1, "{}: {mine:?}", ask.contents[0]);
        seqs.entry(ask.user.clone()).or_default().extend(mine);
    }
    for (user, mut all) in seqs {
        all.sort_unstable();
        assert_eq!(all, (1..=8).collect::<Vec<i64>>(), "{user}");
    }
}

/// Postgres only: the connection of a shared commit is cut while the
/// commit is in flight (a trigger of the test's own makes it slow, and the
/// test terminates its backend). Every caller of the batch gets a 503, and
/// none of the batch is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_commit_that_loses_its_connection_fails_every_member_and_stores_none() {
    let app = Arc::new(TestApp::new(Backend::Postgres).await);
    let mut admin = sqlx::PgConnection::connect(&app.db_url()).await.unwrap();
    admin
        .execute(
            "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN IF NEW.message LIKE '%slow%' THEN PERFORM pg_sleep(30); END IF;
             RETURN NEW; END $$;
             CREATE TRIGGER slow BEFORE INSERT ON chat_messages
             FOR EACH ROW EXECUTE FUNCTION slow();",
        )
        .await
        .unwrap();
    // The first commit sleeps in the trigger; 20 appends queue behind it.
    let first = {
        let app = app.clone();
        tokio::spawn(async move {
            app.post_json(
                "/v1/users/first/messages",
                &json!({"messages": [{"role": "user", "content": "slow first"}]}),
            )
            .await
        })
    };
    // A sleeping statement, by its backend and its start: through PgBouncer
    // the shared commit may run on the very backend the first one used.
    let sleeping = "SELECT pid, query_start::text FROM pg_stat_activity
                    WHERE wait_event = 'PgSleep'
                    AND datname = current_database() AND pid <> pg_backend_pid()";
    let deadline = Instant::now() + Duration::from_secs(10);
    let (first_pid, first_start): (i32, String) = loop {
        if let Some(first) = sqlx::query_as(sleeping)
            .fetch_optional(&mut admin)
            .await
            .unwrap()
        {
            break first;
        }
        assert!(Instant::now() < deadline, "the first commit never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut callers = JoinSet::new();
    for i in 0..20 {
        let app = app.clone();
        callers.spawn(async move {
            let content = if i == 3 {
                "slow member".to_owned()
            } else {
                format!("m{i}")
            };
            let user = format!("b{}", i % 4);
            let reply = app
                .post_json(
                    &format!("/v1/users/{user}/messages"),
                    &json!({"messages": [{"role": "user", "content": content}]}),
                )
                .await;
            (user, reply)
        });
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Free the first commit; the batch behind it then sleeps in turn.
    sqlx::query("SELECT pg_cancel_backend($1)")
        .bind(first_pid)
        .execute(&mut admin)
        .await
        .unwrap();
    let batch_pid: i32 = loop {
        let now: Option<(i32, String)> = sqlx::query_as(sleeping)
            .fetch_optional(&mut admin)
            .await
            .unwrap();
        if let Some((pid, _)) = now.filter(|(_, start)| *start != first_start) {
            break pid;
        }
        assert!(Instant::now() < deadline, "the shared commit never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(batch_pid)
        .execute(&mut admin)
        .await
        .unwrap();
    let first = first.await.unwrap();
    assert!(first.status.is_server_error(), "{}", first.body);
    let mut failed = 0;
    while let Some(done) = callers.join_next().await {
        let (_, reply) = done.unwrap();
        let detail = reply.problem(StatusCode::SERVICE_UNAVAILABLE);
        assert!(detail.contains("Idempotency-Key"), "{detail}");
        assert_eq!(reply.headers["retry-after"], "1");
        failed += 1;
    }
    assert_eq!(failed, 20);
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM chat_messages")
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert_eq!(stored, 0, "nothing of the failed batch is stored");
    // And the store goes on: the next append is written.
    admin
        .execute("DROP TRIGGER slow ON chat_messages")
        .await
        .unwrap();
    app.append("after", json!([{"role": "user", "content": "later"}]))
        .await;
}

/// One POST over a fresh connection, tolerant of a server that dies
/// mid-way: the 201 body, or `None`.
fn post(address: SocketAddr, path: &str, body: &str) -> Option<Value> {
    let mut stream = TcpStream::connect(address).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    if !response.starts_with("HTTP/1.1 201") {
        return None;
    }
    serde_json::from_str(response.split_once("\r\n\r\n")?.1).ok()
}

/// `kill -9` while 32 callers append to 20 users: every message a caller
/// was told is stored is there, once, with the seq it was told.
async fn kill_9_during_coalesced_load_loses_no_acknowledged_message(backend: Backend) {
    let db = TestDb::new(backend).await;
    db.store().await.close().await;
    let replica = Replica::start(&db.url);
    let address = replica.address;
    let stop = Arc::new(AtomicBool::new(false));
    // (user, content) -> the seq its caller was told.
    let acknowledged = Arc::new(Mutex::new(HashMap::<(String, String), i64>::new()));
    let mut callers = Vec::new();
    for caller in 0..32 {
        let (stop, acknowledged) = (stop.clone(), acknowledged.clone());
        callers.push(std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let user = format!("k{}", (caller + n) % 20);
                let contents = [format!("{caller}-{n}-a"), format!("{caller}-{n}-b")];
                let body = json!({"messages": [
                    {"role": "user", "content": contents[0]},
                    {"role": "assistant", "content": contents[1]},
                ]})
                .to_string();
                if let Some(reply) = post(address, &format!("/v1/users/{user}/messages"), &body) {
                    let mut acknowledged = acknowledged.lock().unwrap();
                    for (m, content) in reply["messages"].as_array().unwrap().iter().zip(contents) {
                        acknowledged.insert((user.clone(), content), m["seq"].as_i64().unwrap());
                    }
                }
                n += 1;
            }
        }));
    }
    // Kill once a good number of appends were acknowledged.
    let deadline = Instant::now() + Duration::from_secs(30);
    while acknowledged.lock().unwrap().len() < 2_000 {
        assert!(Instant::now() < deadline, "the load never got going");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(replica); // SIGKILL, mid-load
    stop.store(true, Ordering::Relaxed);
    for caller in callers {
        caller.join().unwrap();
    }
    let acknowledged = acknowledged.lock().unwrap().clone();

    let store = db.store().await;
    let mut found = HashMap::new();
    for user in 0..20 {
        let user = format!("k{user}");
        let mut after = 0;
        loop {
            let page = store
                .history_window(
                    &Tenant::default_tenant(),
                    &UserId::parse(&user).unwrap(),
                    chat_history::domain::HistoryQuery {
                        limit: 1000,
                        not_before: None,
                        before: None,
                        after: Some(after),
                    },
                )
                .await
                .unwrap();
            for m in &page.messages {
                let content = serde_json::from_str::<Value>(m.message.get()).unwrap()["content"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                let earlier = found.insert((user.clone(), content), m.seq);
                assert!(earlier.is_none(), "{user}: a message stored twice");
                after = m.seq;
            }
            if !page.has_more {
                break;
            }
        }
    }
    let mut missing = 0;
    for (key, seq) in &acknowledged {
        match found.get(key) {
            Some(stored) => assert_eq!(stored, seq, "{key:?} moved"),
            None => missing += 1,
        }
    }
    assert_eq!(missing, 0, "acknowledged messages lost after kill -9");
    println!(
        "kill -9 after {} acknowledged messages: all present once with their seq; {} stored in all",
        acknowledged.len(),
        found.len()
    );
}

/// `CHAT_HISTORY_COMMIT_BATCH=1` (the setting for Citus) also turns read
/// coalescing off: four reads stopped by a lock are four single-user
/// statements waiting, not two lanes with the rest queued behind them.
#[tokio::test]
async fn with_commit_batch_one_every_read_is_its_own_statement() {
    use chat_history::domain::HistoryQuery;
    let db = TestDb::new(Backend::Postgres).await;
    db.store().await.close().await;
    let options = ConnectOptions {
        commit_batch: 1,
        ..ConnectOptions::default()
    };
    let store = chat_history::store::connect(&DatabaseUrl::new(&db.url), options)
        .await
        .unwrap();
    let mut admin = sqlx::PgConnection::connect(&db.direct_url).await.unwrap();
    admin.execute("BEGIN").await.unwrap();
    admin
        .execute("LOCK TABLE chat_messages IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let mut readers = JoinSet::new();
    for user in 0..4 {
        let store = store.clone();
        readers.spawn(async move {
            let query = HistoryQuery {
                limit: 20,
                not_before: None,
                before: None,
                after: None,
            };
            let user = UserId::parse(format!("r{user}")).unwrap();
            store
                .history_window(&Tenant::default_tenant(), &user, query)
                .await
                .unwrap()
        });
    }
    let mut observer = sqlx::PgConnection::connect(&db.direct_url).await.unwrap();
    let waiting = "SELECT query FROM pg_stat_activity
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let deadline = Instant::now() + Duration::from_secs(10);
    let statements: Vec<String> = loop {
        let now: Vec<String> = sqlx::query_scalar(waiting)
            .fetch_all(&mut observer)
            .await
            .unwrap();
        if now.len() == 4 {
            break now;
        }
        assert!(
            Instant::now() < deadline,
            "4 reads should wait as 4 statements; waiting: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        statements.iter().all(|q| !q.contains("unnest")),
        "{statements:?}"
    );
    admin.execute("COMMIT").await.unwrap();
    while let Some(page) = readers.join_next().await {
        assert!(page.unwrap().messages.is_empty());
    }
    store.close().await;
}
