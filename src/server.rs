//! Running the service: connect, migrate, bind, serve until a shutdown
//! signal, then drain in-flight requests and close the database pools.

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::{router, AppState};
use crate::cleanup;
use crate::config::Config;
use crate::store::{self, redact_url, Store};

pub type StartError = Box<dyn std::error::Error + Send + Sync>;

/// `chat-history serve`: the whole life of the service.
pub async fn serve(config: Config) -> Result<(), StartError> {
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
        database = %redact_url(&config.database_url),
        "chat-history is listening"
    );
    let state = AppState {
        store: store.clone(),
        limits: config.limits(),
        access: Arc::new(access),
    };
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
                redact_url(&config.database_url),
                crate::error::error_chain(&e)
            )
        })?;
    store.migrate().await.map_err(|e| {
        format!(
            "cannot migrate DATABASE_URL {}: {}",
            redact_url(&config.database_url),
            crate::error::error_chain(&e)
        )
    })?;
    Ok(store)
}

/// Serves `state` on `listener` until `shutdown` completes, then lets
/// in-flight requests finish. Tests bind port 0 and call this.
pub async fn launch(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
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
