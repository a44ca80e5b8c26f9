//! Start-up as an operator meets it: bad settings stop the binary with a
//! message that names them.

use std::ffi::OsString;
use std::process::Command;

use crate::support::{Backend, Replica, TestDb};

fn run(envs: &[(&str, &str)], args: &[&str]) -> (i32, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_chat-history"))
        .args(args)
        .envs(envs.iter().copied())
        .env("DATABASE_URL", "sqlite://never-created-by-this-test.db")
        .output()
        .expect("run the binary");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn a_malformed_environment_value_names_its_variable() {
    let (code, stderr) = run(&[("CHAT_HISTORY_MAX_BATCH", "lots")], &["serve"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("CHAT_HISTORY_MAX_BATCH"), "{stderr}");
    assert!(stderr.contains("--max-batch"), "{stderr}");
}

#[test]
fn a_malformed_flag_names_the_flag() {
    let (code, stderr) = run(&[], &["--retention", "soon", "serve"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--retention"), "{stderr}");
    assert!(
        stderr.contains("30d"),
        "the message shows the expected form: {stderr}"
    );
}

#[tokio::test]
async fn an_unknown_chat_history_variable_is_a_warning_and_kubernetes_links_pass_silently() {
    let db = TestDb::new(Backend::Sqlite).await;
    let replica = Replica::start_with(
        &db.url,
        &[
            ("CHAT_HISTORY_RETENSION", "1d"),
            ("CHAT_HISTORY_SERVICE_HOST", "10.0.0.1"),
            ("CHAT_HISTORY_SERVICE_PORT", "8080"),
            ("CHAT_HISTORY_PORT", "tcp://10.0.0.1:8080"),
            ("CHAT_HISTORY_PORT_8080_TCP_ADDR", "10.0.0.1"),
        ],
    );
    assert_eq!(replica.http("GET", "/readyz", None).0, 200);
    let logs = replica.logs.lock().unwrap().clone();
    assert!(
        logs.contains("CHAT_HISTORY_RETENSION")
            && logs.contains("did you mean CHAT_HISTORY_RETENTION?"),
        "{logs}"
    );
    assert!(
        !logs.contains("SERVICE_HOST") && !logs.contains("PORT_8080"),
        "{logs}"
    );
}

/// tokio reads `TOKIO_WORKER_THREADS` itself and panics on `0` or `abc`
/// (and tries to start 99999999 threads): the service starts anyway,
/// with a warning that names the variable.
#[tokio::test]
async fn a_tokio_worker_threads_that_tokio_cannot_use_does_not_stop_start_up() {
    for value in ["0", "abc", "99999999"] {
        let db = TestDb::new(Backend::Sqlite).await;
        let replica = Replica::start_with(&db.url, &[("TOKIO_WORKER_THREADS", value)]);
        assert_eq!(replica.http("GET", "/readyz", None).0, 200, "{value}");
        let logs = replica.logs.lock().unwrap().clone();
        assert!(
            logs.contains(&format!(
                "TOKIO_WORKER_THREADS={value} is not a thread count"
            )),
            "{value}: {logs}"
        );
    }
}

/// sqlx refuses every TLS connection when `PGSSLKEY` is set alone or
/// `PGSSLCERT` names a file that is not there; libpq connects without a
/// client certificate then, and so does the service, saying so. The
/// server directly, with TLS required: the variables matter only over TLS.
#[tokio::test]
async fn client_certificate_variables_that_libpq_would_pass_over_do_not_stop_start_up() {
    let db = TestDb::new(Backend::Postgres).await;
    let url = format!("{}?sslmode=require", db.direct_url);
    for (envs, says) in [
        (
            &[("PGSSLKEY", "/nonexistent/client.key")][..],
            "PGSSLKEY is set without PGSSLCERT",
        ),
        (
            &[
                ("PGSSLCERT", "/nonexistent/client.crt"),
                ("PGSSLKEY", "/nonexistent/client.key"),
            ][..],
            "/nonexistent/client.crt\\\", where there is no file: it is passed over with PGSSLKEY",
        ),
    ] {
        let replica = Replica::start_with(&url, envs);
        let (status, body) = replica.http(
            "POST",
            "/v1/users/certless/messages",
            Some(&serde_json::json!({"messages": [{"role": "user", "content": "hi"}]})),
        );
        assert_eq!(status, 201, "{envs:?}: {body}");
        let logs = replica.logs.lock().unwrap().clone();
        assert!(logs.contains(says), "{envs:?}: {logs}");
    }
}

/// `chat-history openapi` parses the whole environment and every setting
/// without touching a database: the quickest start-up there is.
fn openapi_with(envs: &[(OsString, OsString)], args: &[&str]) -> (i32, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_chat-history"))
        .args(args)
        .arg("openapi")
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("run the binary");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[cfg(unix)]
#[test]
fn variables_that_are_not_utf8_stop_start_up_only_when_they_are_ours() {
    use std::os::unix::ffi::OsStringExt;
    let bad = || OsString::from_vec(vec![0xff, 0xfe]);
    let (code, stderr) = openapi_with(
        &[
            (OsString::from("SOMEONE_ELSES"), bad()),
            (bad(), OsString::from("x")),
        ],
        &[],
    );
    assert_eq!(code, 0, "{stderr}");
    for ours in ["CHAT_HISTORY_BIND", "DATABASE_URL", "CHAT_HISTORY_API_KEYS"] {
        let (code, stderr) = openapi_with(&[(OsString::from(ours), bad())], &[]);
        assert_eq!(code, 2, "{stderr}");
        assert!(
            stderr.contains(ours) && stderr.contains("UTF-8"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn a_count_past_its_maximum_stops_start_up_naming_it() {
    let huge = [(
        OsString::from("CHAT_HISTORY_MAX_MESSAGES_PER_USER"),
        OsString::from("18446744073709551615"),
    )];
    let (code, stderr) = openapi_with(&huge, &[]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("CHAT_HISTORY_MAX_MESSAGES_PER_USER"),
        "{stderr}"
    );
    assert!(
        stderr.contains("100000000") && stderr.contains("off"),
        "{stderr}"
    );
    let off = [(
        OsString::from("CHAT_HISTORY_MAX_MESSAGES_PER_USER"),
        OsString::from("off"),
    )];
    assert_eq!(openapi_with(&off, &[]).0, 0);
}

/// Every way start-up can fail on a database it cannot reach, with the
/// password in every place a URL can carry it: it never shows.
#[test]
fn a_database_password_never_appears_in_any_start_up_output() {
    let urls = [
        ("postgres://app:S3CRETa1@127.0.0.1:1/chat", "S3CRETa1"),
        (
            "postgres://app@127.0.0.1:1/chat?password=S3CRETa2",
            "S3CRETa2",
        ),
        ("postgres://app:S3CRET%61a3@127.0.0.1:1/chat", "S3CRET"),
        (
            "postgres://app@127.0.0.1:1/chat?pass%77ord=S3CRETa4",
            "S3CRETa4",
        ),
        (
            "postgres://app@127.0.0.1:1/chat?sslpassword=S3CRETa5&sslmode=disable",
            "S3CRETa5",
        ),
        (
            "postgres://app:S3CRETa6@127.0.0.1:notaport/chat",
            "S3CRETa6",
        ),
    ];
    let runs: Vec<_> = urls
        .iter()
        .flat_map(|(url, secret)| {
            ["migrate", "serve"].into_iter().flat_map(move |command| {
                ["json", "pretty"]
                    .into_iter()
                    .map(move |format| (*url, *secret, command, format))
            })
        })
        .map(|(url, secret, command, format)| {
            std::thread::spawn(move || {
                let port = std::net::TcpListener::bind("127.0.0.1:0")
                    .unwrap()
                    .local_addr()
                    .unwrap()
                    .port();
                let output = Command::new(env!("CARGO_BIN_EXE_chat-history"))
                    .arg(command)
                    .env("DATABASE_URL", url)
                    .env("CHAT_HISTORY_BIND", format!("127.0.0.1:{port}"))
                    .env("CHAT_HISTORY_LOG_FORMAT", format)
                    .env("RUST_LOG", "trace")
                    .output()
                    .unwrap();
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                );
                (url, secret, command, output.status.success(), text)
            })
        })
        .collect();
    for run in runs {
        let (url, secret, command, succeeded, text) = run.join().unwrap();
        assert!(!succeeded, "{command} with {url} cannot succeed: {text}");
        assert!(
            text.contains("DATABASE_URL"),
            "{command} {url}: the error names the setting: {text}"
        );
        assert!(
            !text.to_lowercase().contains(&secret.to_lowercase()),
            "{command} with {url} printed the password: {text}"
        );
    }
}

#[test]
fn an_unsupported_database_url_is_refused_without_its_password() {
    let output = Command::new(env!("CARGO_BIN_EXE_chat-history"))
        .arg("migrate")
        .env("DATABASE_URL", "mysql://app:hunter2@db/chat")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("DATABASE_URL"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

#[test]
fn openapi_prints_the_committed_document() {
    let output = Command::new(env!("CARGO_BIN_EXE_chat-history"))
        .arg("openapi")
        .output()
        .unwrap();
    assert!(output.status.success());
    let committed = include_str!("../../openapi/openapi.json");
    assert!(
        String::from_utf8_lossy(&output.stdout) == committed,
        "`chat-history openapi` differs from openapi/openapi.json; regenerate it with \
         `cargo run -- openapi > openapi/openapi.json`"
    );
}

#[test]
fn an_open_service_refuses_a_public_address() {
    let (code, stderr) = run(&[("CHAT_HISTORY_BIND", "0.0.0.0:0")], &["serve"]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("not a loopback address"), "{stderr}");
    assert!(
        stderr.contains("CHAT_HISTORY_ALLOW_UNAUTHENTICATED"),
        "{stderr}"
    );
}

#[test]
fn a_malformed_key_entry_names_the_entry_and_hides_the_key() {
    let (code, stderr) = run(
        &[(
            "CHAT_HISTORY_API_KEYS",
            "acme:user:first-key-0123456789,acme:owner:hunter2-hunter2-hunter2",
        )],
        &["serve"],
    );
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("CHAT_HISTORY_API_KEYS entry 2 is malformed"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("hunter2") && !stderr.contains("first-key"),
        "{stderr}"
    );
}
