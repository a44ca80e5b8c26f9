//! Graceful shutdown: in-flight requests finish, new connections are
//! refused, the process exits 0 on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chat_history::server::launch;
use chat_history::{AppState, Limits};
use tokio::net::TcpListener;

use crate::support::{Backend, TestDb};

/// Reads one HTTP/1.1 response (the server closes the connection after it).
fn read_response(stream: &mut TcpStream) -> String {
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// Starts appending one message with `content` to user `u`: sends the
/// request head and the first bytes of the body, and returns the connection
/// with the rest of the body, to be written when the test chooses.
fn start_slow_append(address: SocketAddr, content: &str) -> (TcpStream, String) {
    let body = serde_json::json!({"messages": [{"role": "user", "content": content}]}).to_string();
    let (head, tail) = body.split_at(20);
    let mut stream = TcpStream::connect(address).unwrap();
    write!(
        stream,
        "POST /v1/users/u/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{head}",
        body.len()
    )
    .unwrap();
    (stream, tail.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_requests_finish_and_new_connections_are_refused() {
    let db = TestDb::new(Backend::Sqlite).await;
    let state = AppState::open(db.store().await, Limits::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(launch(listener, state, async {
        let _ = stopped.await;
    }));

    // A request whose body is still arriving when the shutdown starts.
    let (mut slow, tail) = start_slow_append(address, "sent slowly");
    // Give the server time to accept the connection and start reading.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(()).unwrap();

    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(address).is_ok() {
        assert!(
            Instant::now() < deadline,
            "no new connections once shutdown has begun"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    slow.write_all(tail.as_bytes()).unwrap();
    let response = tokio::task::spawn_blocking(move || read_response(&mut slow))
        .await
        .unwrap();
    assert!(response.starts_with("HTTP/1.1 201"), "{response}");
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the server stops once in-flight requests are done")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_exits_zero() {
    let db = TestDb::new(Backend::Sqlite).await;
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let address: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_chat-history"))
        .arg("serve")
        .env("DATABASE_URL", &db.url)
        .env("CHAT_HISTORY_BIND", address.to_string())
        .env("CHAT_HISTORY_CLEANUP_INTERVAL", "1s")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the binary");
    let started = Instant::now();
    let mut stream = loop {
        match TcpStream::connect(address) {
            Ok(stream) => break stream,
            Err(_) if started.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("the service did not start: {e}"),
        }
    };
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    assert!(read_response(&mut stream).starts_with("HTTP/1.1 200"));
    // Collect the logs as they come, and let the retention task run once.
    let logs = Arc::new(Mutex::new(String::new()));
    let reader = {
        let logs = logs.clone();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut logs = logs.lock().unwrap();
                logs.push_str(&line);
                logs.push('\n');
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !logs.lock().unwrap().contains("retention run finished") {
        assert!(Instant::now() < deadline, "no retention run");
        std::thread::sleep(Duration::from_millis(50));
    }

    let mut scrape = TcpStream::connect(address).unwrap();
    scrape
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let metrics = read_response(&mut scrape);
    assert!(
        metrics.contains("chat_history_cleanup_runs_total{outcome=\"ok\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("chat_history_cleanup_duration_seconds_bucket"),
        "{metrics}"
    );

    // A request still arriving when the signal comes.
    let (mut slow, tail) = start_slow_append(address, "in flight");
    std::thread::sleep(Duration::from_millis(300));

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    std::thread::sleep(Duration::from_millis(300));
    slow.write_all(tail.as_bytes()).unwrap();
    let answer = read_response(&mut slow);
    assert!(
        answer.starts_with("HTTP/1.1 201"),
        "the in-flight request finished: {answer}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(exit) = child.try_wait().unwrap() {
            break exit;
        }
        assert!(
            Instant::now() < deadline,
            "the service did not stop within 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    reader.join().unwrap();
    let logs = logs.lock().unwrap().clone();
    assert!(exit.success(), "exit {exit:?}; logs:\n{logs}");
    assert!(logs.contains("retention run finished"), "{logs}");
    assert!(logs.contains("retention task stopped"), "{logs}");
}
