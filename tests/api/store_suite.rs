//! The behaviour of `Store`, written once and run on Postgres and SQLite.

use chat_history::domain::{
    AppendOutcome, Appended, HistoryQuery, NewMessage, Tenant, Timestamp, UserId,
};
use chat_history::store::{Store, StoreError};
use serde_json::{json, Value};

use crate::on_both_backends;
use crate::support::{Backend, TestDb};

on_both_backends!(
    append_allocates_seq_from_one_and_bumps_version,
    messages_come_back_as_the_same_json_values,
    newest_window_is_returned_oldest_first,
    age_filter_applies_before_the_limit,
    forward_paging_starts_inside_the_window,
    forward_paging_finds_every_window_start_across_gaps,
    before_and_after_bound_the_page,
    seq_and_version_never_repeat_after_a_clear,
    deleting_one_message_updates_the_stats,
    created_at_never_goes_backwards,
    list_users_orders_by_bytes_and_pages,
    tenants_are_separate_histories,
    cap_evicts_the_oldest_even_from_the_same_batch,
    readiness_needs_migrations,
);

const T0: i64 = 1_796_000_000_000_000; // 2026-11-30, in microseconds

fn tenant() -> Tenant {
    Tenant::default_tenant()
}

fn user(id: &str) -> UserId {
    UserId::parse(id).unwrap()
}

fn msgs(values: &[Value]) -> Vec<NewMessage> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| NewMessage::from_value(v.clone(), &format!("messages[{i}]")).unwrap())
        .collect()
}

fn text(n: usize) -> Vec<NewMessage> {
    let values: Vec<Value> = (0..n)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("m{i}")}))
        .collect();
    msgs(&values)
}

/// Appends without an idempotency key; the outcome must be `Stored`.
async fn append(
    store: &dyn Store,
    tenant: &Tenant,
    user: &UserId,
    messages: &[NewMessage],
    at: Timestamp,
    cap: Option<u64>,
) -> Appended {
    match store
        .append_messages(tenant, user, messages, at, cap, None)
        .await
        .unwrap()
    {
        AppendOutcome::Stored(appended) => appended,
        other => panic!("expected Stored, got {other:?}"),
    }
}

async fn append_at(store: &dyn Store, id: &str, n: usize, at_micros: i64) -> Vec<i64> {
    append(
        store,
        &tenant(),
        &user(id),
        &text(n),
        Timestamp::from_micros(at_micros),
        None,
    )
    .await
    .messages
    .iter()
    .map(|m| m.seq)
    .collect()
}

fn seqs(page: &chat_history::domain::HistoryPage) -> Vec<i64> {
    page.messages.iter().map(|m| m.seq).collect()
}

fn window(limit: u32) -> HistoryQuery {
    HistoryQuery {
        limit,
        not_before: None,
        before: None,
        after: None,
    }
}

async fn append_allocates_seq_from_one_and_bumps_version(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    let first = append(
        &*store,
        &tenant(),
        &user("u"),
        &text(3),
        Timestamp::from_micros(T0),
        None,
    )
    .await;
    assert_eq!(
        first.messages.iter().map(|m| m.seq).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!(first.version, 1);
    let second = append(
        &*store,
        &tenant(),
        &user("u"),
        &text(2),
        Timestamp::from_micros(T0 + 1),
        None,
    )
    .await;
    assert_eq!(
        second.messages.iter().map(|m| m.seq).collect::<Vec<_>>(),
        [4, 5]
    );
    assert_eq!(second.version, 2);
    let stats = store
        .user_stats(&tenant(), &user("u"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (stats.message_count, stats.first_seq, stats.last_seq),
        (5, 1, 5)
    );
    assert_eq!(stats.oldest_at, Timestamp::from_micros(T0));
    assert_eq!(stats.newest_at, Timestamp::from_micros(T0 + 1));
    assert_eq!(stats.version, 2);
}

async fn messages_come_back_as_the_same_json_values(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    let written: Vec<Value> = [
        r#"{"role":"system","content":"Be brief. 🌍 «ünïcödé» \" \\ \n\t"}"#,
        r#"{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]}"#,
        r#"{"role":"tool","tool_call_id":"call_1","content":[{"type":"text","text":"18C"}],"metadata":{"n":123456789012345678901234567890,"f":0.1,"e":1e400,"neg":-0,"t":true,"nested":[[],{}]}}"#,
        r#"{"role":"custom-role","name":"x","extra":{"deep":{"deeper":[1,2,{"k":"v"}]}}}"#,
    ]
    .iter()
    .map(|s| serde_json::from_str(s).unwrap())
    .collect();
    append(
        &*store,
        &tenant(),
        &user("u"),
        &msgs(&written),
        Timestamp::from_micros(T0),
        None,
    )
    .await;
    let page = store
        .history_window(&tenant(), &user("u"), window(10))
        .await
        .unwrap();
    let read: Vec<Value> = page
        .messages
        .iter()
        .map(|m| serde_json::from_str(m.message.get()).unwrap())
        .collect();
    assert_eq!(read, written);
    assert!(page.messages[2]
        .message
        .get()
        .contains("123456789012345678901234567890"));
    assert!(page.messages[2].message.get().contains("1e+400"));
    let one = store
        .message(&tenant(), &user("u"), 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(one.message.get()).unwrap(),
        written[1]
    );
}

async fn newest_window_is_returned_oldest_first(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    append_at(&*store, "u", 7, T0).await;
    let page = store
        .history_window(&tenant(), &user("u"), window(3))
        .await
        .unwrap();
    assert_eq!(seqs(&page), [5, 6, 7]);
    assert!(page.has_more);
    let page = store
        .history_window(&tenant(), &user("u"), window(7))
        .await
        .unwrap();
    assert_eq!(seqs(&page), [1, 2, 3, 4, 5, 6, 7]);
    assert!(!page.has_more);
    let unknown = store
        .history_window(&tenant(), &user("nobody"), window(3))
        .await
        .unwrap();
    assert!(unknown.messages.is_empty() && !unknown.has_more);
}

async fn age_filter_applies_before_the_limit(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    let hour = 3_600_000_000;
    append_at(&*store, "u", 4, T0).await; // 1..=4, old
    append_at(&*store, "u", 2, T0 + 5 * hour).await; // 5..=6, recent
    let recent = |limit| HistoryQuery {
        not_before: Some(Timestamp::from_micros(T0 + 4 * hour)),
        ..window(limit)
    };
    let page = store
        .history_window(&tenant(), &user("u"), recent(10))
        .await
        .unwrap();
    assert_eq!(seqs(&page), [5, 6]);
    assert!(
        !page.has_more,
        "older messages fail the filter, so nothing more passes"
    );
    let page = store
        .history_window(&tenant(), &user("u"), recent(1))
        .await
        .unwrap();
    assert_eq!(seqs(&page), [6]);
    assert!(page.has_more);
    let all_old = HistoryQuery {
        not_before: Some(Timestamp::from_micros(T0 + 6 * hour)),
        ..window(10)
    };
    let page = store
        .history_window(&tenant(), &user("u"), all_old)
        .await
        .unwrap();
    assert!(page.messages.is_empty() && !page.has_more);
}

async fn forward_paging_starts_inside_the_window(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    let hour = 3_600_000_000;
    append_at(&*store, "u", 5, T0).await; // 1..=5, old
    append_at(&*store, "u", 5, T0 + 5 * hour).await; // 6..=10, recent
    let forward = |after, limit| HistoryQuery {
        limit,
        not_before: Some(Timestamp::from_micros(T0 + hour)),
        before: None,
        after: Some(after),
    };
    let page = store
        .history_window(&tenant(), &user("u"), forward(0, 3))
        .await
        .unwrap();
    assert_eq!(seqs(&page), [6, 7, 8]);
    assert!(page.has_more);
    let page = store
        .history_window(&tenant(), &user("u"), forward(8, 3))
        .await
        .unwrap();
    assert_eq!(seqs(&page), [9, 10]);
    assert!(!page.has_more);
    let page = store
        .history_window(&tenant(), &user("u"), forward(10, 3))
        .await
        .unwrap();
    assert!(page.messages.is_empty() && !page.has_more);
    let no_age = HistoryQuery {
        not_before: None,
        ..forward(0, 3)
    };
    let page = store
        .history_window(&tenant(), &user("u"), no_age)
        .await
        .unwrap();
    assert_eq!(seqs(&page), [1, 2, 3]);
}

/// Where a forward page starts is searched for by `seq` (no index on
/// `created_at`): against every age cutoff and every `after`, with gaps in
/// the seqs, the page holds exactly the messages a scan would pick.
async fn forward_paging_finds_every_window_start_across_gaps(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    let hour = 3_600_000_000;
    let mut stored: Vec<(i64, i64)> = Vec::new(); // (seq, created_at)
    for (group, n) in [3, 1, 4, 1, 5, 2, 6, 1, 3].into_iter().enumerate() {
        let at = T0 + group as i64 * hour;
        for seq in append_at(&*store, "u", n, at).await {
            stored.push((seq, at));
        }
    }
    // Gaps: a whole group (seq 4), the group's first and last, a run.
    for gone in [4, 5, 8, 14, 15, 16, 26] {
        assert!(store
            .delete_message(&tenant(), &user("u"), gone)
            .await
            .unwrap());
        stored.retain(|&(seq, _)| seq != gone);
    }
    let last = stored.last().unwrap().0;
    let mut cutoffs: Vec<i64> = (0..10).map(|g| T0 + g * hour).collect();
    cutoffs.extend([T0 - 1, T0 + 1, T0 + 3 * hour + 1, T0 + 8 * hour + 1]);
    for cutoff in cutoffs {
        for after in 0..=last + 1 {
            let query = HistoryQuery {
                limit: 1000,
                not_before: Some(Timestamp::from_micros(cutoff)),
                before: None,
                after: Some(after),
            };
            let page = store
                .history_window(&tenant(), &user("u"), query)
                .await
                .unwrap();
            let expected: Vec<i64> = stored
                .iter()
                .filter(|&&(seq, at)| seq > after && at >= cutoff)
                .map(|&(seq, _)| seq)
                .collect();
            assert_eq!(
                seqs(&page),
                expected,
                "after={after}, cutoff=T0+{}",
                cutoff - T0
            );
            assert!(!page.has_more);
        }
    }
    let far = HistoryQuery {
        limit: 10,
        not_before: Some(Timestamp::from_micros(T0)),
        before: None,
        after: Some(i64::MAX),
    };
    let page = store
        .history_window(&tenant(), &user("u"), far)
        .await
        .unwrap();
    assert!(page.messages.is_empty() && !page.has_more);
    let below_zero = HistoryQuery {
        limit: 1000,
        after: Some(-3),
        ..far
    };
    let page = store
        .history_window(&tenant(), &user("u"), below_zero)
        .await
        .unwrap();
    let all: Vec<i64> = stored.iter().map(|&(seq, _)| seq).collect();
    assert_eq!(
        seqs(&page),
        all,
        "an `after` below 0 starts at the beginning"
    );
    let nobody = HistoryQuery {
        after: Some(0),
        ..far
    };
    let page = store
        .history_window(&tenant(), &user("nobody"), nobody)
        .await
        .unwrap();
    assert!(page.messages.is_empty() && !page.has_more);
}

async fn before_and_after_bound_the_page(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    append_at(&*store, "u", 10, T0).await;
    let back = HistoryQuery {
        before: Some(8),
        ..window(3)
    };
    let page = store
        .history_window(&tenant(), &user("u"), back)
        .await
        .unwrap();
    assert_eq!(seqs(&page), [5, 6, 7]);
    assert!(page.has_more);
    let back = HistoryQuery {
        before: Some(3),
        ..window(3)
    };
    let page = store
        .history_window(&tenant(), &user("u"), back)
        .await
        .unwrap();
    assert_eq!(seqs(&page), [1, 2]);
    assert!(!page.has_more);
    let both = HistoryQuery {
        before: Some(8),
        after: Some(2),
        ..window(10)
    };
    let page = store
        .history_window(&tenant(), &user("u"), both)
        .await
        .unwrap();
    assert_eq!(seqs(&page), [3, 4, 5, 6, 7]);
    assert!(!page.has_more);
    let both = HistoryQuery {
        before: Some(8),
        after: Some(2),
        ..window(2)
    };
    let page = store
        .history_window(&tenant(), &user("u"), both)
        .await
        .unwrap();
    assert_eq!(seqs(&page), [3, 4]);
    assert!(page.has_more);
}

async fn seq_and_version_never_repeat_after_a_clear(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    append_at(&*store, "u", 3, T0).await;
    assert_eq!(store.clear_user(&tenant(), &user("u")).await.unwrap(), 3);
    assert!(store
        .user_stats(&tenant(), &user("u"))
        .await
        .unwrap()
        .is_none());
    assert_eq!(store.clear_user(&tenant(), &user("u")).await.unwrap(), 0);
    let again = append(
        &*store,
        &tenant(),
        &user("u"),
        &text(2),
        Timestamp::from_micros(T0 + 1),
        None,
    )
    .await;
    assert_eq!(
        again.messages.iter().map(|m| m.seq).collect::<Vec<_>>(),
        [4, 5]
    );
    assert_eq!(again.version, 3, "append, clear, append: three writes");
    let stats = store
        .user_stats(&tenant(), &user("u"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (stats.message_count, stats.first_seq, stats.last_seq),
        (2, 4, 5)
    );
}

async fn deleting_one_message_updates_the_stats(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    append_at(&*store, "u", 3, T0).await;
    assert!(store
        .delete_message(&tenant(), &user("u"), 3)
        .await
        .unwrap());
    assert!(!store
        .delete_message(&tenant(), &user("u"), 3)
        .await
        .unwrap());
    assert!(!store
        .delete_message(&tenant(), &user("nobody"), 1)
        .await
        .unwrap());
    assert!(store
        .message(&tenant(), &user("u"), 3)
        .await
        .unwrap()
        .is_none());
    let stats = store
        .user_stats(&tenant(), &user("u"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (stats.message_count, stats.first_seq, stats.last_seq),
        (2, 1, 2)
    );
    assert_eq!(stats.version, 2);
    assert!(store
        .delete_message(&tenant(), &user("u"), 1)
        .await
        .unwrap());
    assert!(store
        .delete_message(&tenant(), &user("u"), 2)
        .await
        .unwrap());
    assert!(store
        .user_stats(&tenant(), &user("u"))
        .await
        .unwrap()
        .is_none());
    let (users, _) = store.list_users(&tenant(), None, 10).await.unwrap();
    assert!(users.is_empty());
}

async fn created_at_never_goes_backwards(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    append_at(&*store, "u", 1, T0).await;
    // A replica with a slower clock appends next.
    let late = append(
        &*store,
        &tenant(),
        &user("u"),
        &text(1),
        Timestamp::from_micros(T0 - 5_000_000),
        None,
    )
    .await;
    assert_eq!(late.messages[0].created_at, Timestamp::from_micros(T0));
    let page = store
        .history_window(&tenant(), &user("u"), window(10))
        .await
        .unwrap();
    assert!(page
        .messages
        .windows(2)
        .all(|w| w[0].created_at <= w[1].created_at));
}

async fn list_users_orders_by_bytes_and_pages(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    // Byte order, not a locale's: 'B' < 'a' < 'é' (0xC3…) and '+' < '0'.
    for id in ["a", "é", "B", "+1555", "0", "whatsapp:+44"] {
        append_at(&*store, id, 1, T0).await;
    }
    append_at(&*store, "gone", 1, T0).await;
    store.clear_user(&tenant(), &user("gone")).await.unwrap();
    let (page, more) = store.list_users(&tenant(), None, 4).await.unwrap();
    let ids: Vec<&str> = page.iter().map(|u| u.user_id.as_str()).collect();
    assert_eq!(ids, ["+1555", "0", "B", "a"]);
    assert!(more);
    let (page, more) = store
        .list_users(&tenant(), Some(&user("a")), 4)
        .await
        .unwrap();
    let ids: Vec<&str> = page.iter().map(|u| u.user_id.as_str()).collect();
    assert_eq!(ids, ["whatsapp:+44", "é"]);
    assert!(!more);
    assert_eq!(page[0].message_count, 1);
    assert_eq!(page[0].newest_at, Timestamp::from_micros(T0));
}

async fn tenants_are_separate_histories(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    let (a, b) = (Tenant::new("a"), Tenant::new("b"));
    append(
        &*store,
        &a,
        &user("u"),
        &text(2),
        Timestamp::from_micros(T0),
        None,
    )
    .await;
    let in_b = append(
        &*store,
        &b,
        &user("u"),
        &text(1),
        Timestamp::from_micros(T0),
        None,
    )
    .await;
    assert_eq!(in_b.messages[0].seq, 1);
    assert_eq!(store.clear_user(&b, &user("u")).await.unwrap(), 1);
    let stats = store.user_stats(&a, &user("u")).await.unwrap().unwrap();
    assert_eq!(stats.message_count, 2);
    assert!(store.message(&b, &user("u"), 1).await.unwrap().is_none());
    assert!(!store.delete_message(&b, &user("u"), 2).await.unwrap());
    let (users, _) = store.list_users(&b, None, 10).await.unwrap();
    assert!(users.is_empty());
    let (users, _) = store.list_users(&a, None, 10).await.unwrap();
    assert_eq!(users.len(), 1);
}

async fn cap_evicts_the_oldest_even_from_the_same_batch(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.store().await;
    let cap = Some(3);
    let append = |n: usize| {
        let store = store.clone();
        async move {
            append(
                &*store,
                &tenant(),
                &user("u"),
                &text(n),
                Timestamp::from_micros(T0),
                cap,
            )
            .await
        }
    };
    append(2).await;
    let appended = append(5).await; // seq 3..=7; only 5, 6, 7 stay
    assert_eq!(
        appended.messages.len(),
        5,
        "the reply lists every appended message"
    );
    let page = store
        .history_window(&tenant(), &user("u"), window(10))
        .await
        .unwrap();
    assert_eq!(seqs(&page), [5, 6, 7]);
    let stats = store
        .user_stats(&tenant(), &user("u"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stats.message_count, 3);
    // With a hole, the cap keeps as many messages as it allows.
    assert!(store
        .delete_message(&tenant(), &user("u"), 6)
        .await
        .unwrap());
    append(1).await; // 5, 7, 8
    let page = store
        .history_window(&tenant(), &user("u"), window(10))
        .await
        .unwrap();
    assert_eq!(seqs(&page), [5, 7, 8]);
}

async fn readiness_needs_migrations(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = db.unmigrated_store().await;
    assert!(matches!(
        store.ready().await,
        Err(StoreError::NotMigrated { applied: None, .. })
    ));
    store.migrate().await.unwrap();
    store.ready().await.unwrap();
    store.migrate().await.unwrap(); // idempotent
}
