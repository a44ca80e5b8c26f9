//! Running the service: connect, migrate, bind, serve until a shutdown
//! signal, then drain in-flight requests and close the database pools.

use std::future::Future;
use std::sync::Arc;

use std::time::Duration;

use axum::http::StatusCode;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_io_timeout::TimeoutStream;
use tokio_util::sync::CancellationToken;

use crate::api::{router, AppState};
use crate::cleanup;
use crate::config::Config;
use crate::error::{Problem, PROBLEM_JSON};
use crate::store::{self, Store};

pub type StartError = Box<dyn std::error::Error + Send + Sync>;

/// `chat-history serve`: the whole life of the service.
pub async fn serve(config: Config) -> Result<(), StartError> {
    let limits = config.limits()?;
    let (access, warnings) = config.access()?;
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    if access.is_open() {
        if !config.bind.ip().is_loopback() && !config.allow_unauthenticated {
            return Err(format!(
                "CHAT_HISTORY_BIND {} is not a loopback address and no API keys are configured; \
                 set CHAT_HISTORY_API_KEYS (or CHAT_HISTORY_API_KEYS_FILE), or \
                 CHAT_HISTORY_ALLOW_UNAUTHENTICATED=true if an open service is intended",
                config.bind
            )
            .into());
        }
        tracing::warn!(
            "no API keys are configured: anyone who can reach {} can read and change every history",
            config.bind
        );
        if config.rate_limit.0.is_some() {
            tracing::warn!("CHAT_HISTORY_RATE_LIMIT applies per API key, and none is configured");
        }
    }
    let store = connect_and_migrate(&config).await?;
    let listener = TcpListener::bind(config.bind)
        .await
        .map_err(|e| format!("cannot listen on {} (CHAT_HISTORY_BIND): {e}", config.bind))?;
    tracing::info!(
        address = %listener.local_addr()?,
        database = %config.database_url,
        "chat-history is listening"
    );
    let state = AppState {
        store: store.clone(),
        limits,
        access: Arc::new(access),
    };
    // The recorder before the retention task, whose first run starts at
    // once: counted before it is installed, a run would go unrecorded.
    crate::telemetry::metrics();
    let shutdown = CancellationToken::new();
    let retention = cleanup::spawn(
        store.clone(),
        config.retention.0.map(|r| r.0),
        config.cleanup_interval.0,
        shutdown.clone(),
    );
    let signalled = shutdown.clone();
    launch(listener, state, async move {
        shutdown_signal().await;
        signalled.cancel();
    })
    .await?;
    shutdown.cancel();
    if let Err(e) = retention.await {
        tracing::error!("retention task failed: {e}");
    }
    store.close().await;
    tracing::info!("stopped");
    Ok(())
}

/// `chat-history healthcheck`: a GET of `/healthz` on the port the service
/// binds (on loopback when it binds every address), within two seconds.
pub async fn healthcheck(config: Config) -> Result<(), StartError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut address = config.bind;
    if address.ip().is_unspecified() {
        address.set_ip(match address {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let check = async {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(std::time::Duration::from_secs(2), check)
        .await
        .map_err(|_| format!("no answer from {address} within 2 s"))?
        .map_err(|e| format!("cannot reach {address}: {e}"))?;
    if response.starts_with(b"HTTP/1.1 200") {
        Ok(())
    } else {
        let status = String::from_utf8_lossy(&response);
        let status = status.lines().next().unwrap_or_default();
        Err(format!("{address}/healthz answered {status:?}").into())
    }
}

/// `chat-history migrate`.
pub async fn migrate(config: Config) -> Result<(), StartError> {
    let store = connect_and_migrate(&config).await?;
    store.close().await;
    tracing::info!("migrations applied");
    Ok(())
}

async fn connect_and_migrate(config: &Config) -> Result<Arc<dyn Store>, StartError> {
    let store = store::connect(&config.database_url, config.connect_options())
        .await
        .map_err(|e| {
            format!(
                "cannot open DATABASE_URL {}: {}",
                config.database_url,
                crate::error::error_chain(&e)
            )
        })?;
    store.migrate().await.map_err(|e| {
        let what = match e {
            store::StoreError::Migrate(_) => "cannot migrate",
            _ => "cannot connect to",
        };
        format!(
            "{what} DATABASE_URL {}: {}",
            config.database_url,
            crate::error::error_chain(&e)
        )
    })?;
    Ok(store)
}

/// How much one connection's read buffer may hold while a request head is
/// incomplete, and what its write buffer queues before hyper waits for the
/// client. A head still incomplete past it gets 431 and the connection is
/// closed (hyper checks between reads, and one read can take the buffer
/// to about twice this); a body streams through it. hyper's default,
/// about 400 KiB, let 1,000 connections that each sent most of a 390 KB
/// head and stopped take the process from 21 MiB to 543 MiB until the
/// header timeout; this bounds that to about `max_connections` × 64 KiB.
/// Heads of real clients are a few KiB (a long bearer token included);
/// nginx's default bound is 32 KiB too. The cost: an answer of several MiB
/// is sent about 13 % slower than with hyper's default (64 KiB: 3 %, but
/// twice the memory per incomplete head).
pub const MAX_BUFFER_BYTES: usize = 32 * 1024;

/// Serves `state` on `listener` until `shutdown` completes, then lets
/// in-flight requests finish. Tests bind port 0 and call this.
///
/// HTTP/1.1 through hyper with a timer, so that a request head must arrive
/// within `header_timeout` (hyper runs the same clock while a keep-alive
/// connection waits for its next request, which closes idle connections);
/// at most `max_connections` are open at once, and one more is answered 503
/// and closed rather than queued. A client that takes none of what the
/// server writes to it for `request_timeout` is disconnected, so that a
/// reader that stops reading gives back its connection, and the answer
/// bytes it holds (see `protect`), instead of keeping them for ever.
pub async fn launch(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.limits;
    let service = TowerToHyperService::new(router(state));
    let open = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_BUFFER_BYTES);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before
                    // it was accepted: wait a little rather than spin.
                    tracing::warn!("cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            metrics::counter!("chat_history_connections_refused_total").increment(1);
            tokio::spawn(refuse(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mut stream = TimeoutStream::new(stream);
        stream.set_write_timeout(Some(limits.request_timeout));
        let connection =
            graceful.watch(http.serve_connection(TokioIo::new(Box::pin(stream)), service.clone()));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("connection ended: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Answers a connection over the cap with a 503 and closes it, reading
/// what the client sent first (briefly) so that the close does not reset
/// the connection before the client has read the answer.
async fn refuse(mut stream: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = serde_json::to_string(&Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "this server has as many connections open as it accepts (CHAT_HISTORY_MAX_CONNECTIONS); retry after the delay in Retry-After",
    ))
    .unwrap_or_default();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: {PROBLEM_JSON}\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let mut request = [0u8; 4096];
        let _ = tokio::time::timeout(Duration::from_millis(200), stream.read(&mut request)).await;
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        while stream.read(&mut request).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// Completes on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutting down: finishing in-flight requests");
}
