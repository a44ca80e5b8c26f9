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
