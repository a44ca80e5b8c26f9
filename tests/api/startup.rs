//! Start-up as an operator meets it: bad settings stop the binary with a
//! message that names them.

use std::process::Command;

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

#[test]
fn an_unknown_chat_history_variable_stops_start_up() {
    let (code, stderr) = run(&[("CHAT_HISTORY_RETENSION", "1d")], &["serve"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("unknown setting CHAT_HISTORY_RETENSION"),
        "{stderr}"
    );
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
