//! Command line and environment: every setting is a flag with an environment
//! fallback. A malformed or out-of-range value stops start-up with a message
//! that names the setting; a `CHAT_HISTORY_*` variable that names no setting
//! is a warning, never a stop, because the environment is shared.

use std::ffi::OsString;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};

use crate::auth::{Access, Rate};
use crate::store::{ConnectOptions, DatabaseUrl};
use crate::telemetry::LogFormat;

/// Prefix of the service's own environment variables.
const ENV_PREFIX: &str = "CHAT_HISTORY_";

#[derive(Debug, Parser)]
#[command(name = "chat-history", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub config: Config,
}

#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Run the HTTP service (the default).
    Serve,
    /// Apply pending database migrations and exit.
    Migrate,
    /// Print the OpenAPI document and exit.
    Openapi,
    /// Ask the service at CHAT_HISTORY_BIND whether it is alive (`/healthz`);
    /// exits 0 if so. For container health checks: needs no curl.
    Healthcheck,
    /// Copy every tenant's histories from one store to another (SQLite to
    /// Postgres, Postgres to SQLite, Postgres to Postgres), exactly, then
    /// verify them. Resumable: run it again after an interruption.
    Copy(CopyArgs),
    /// Write histories from DATABASE_URL to stdout as NDJSON: a header line,
    /// a line per message, a line of counters per user, an end line.
    Export(ExportArgs),
    /// Read an export from stdin into DATABASE_URL, one user per transaction.
    Import(ImportArgs),
}

#[derive(Debug, Clone, Args)]
pub struct CopyArgs {
    /// The store to read: sqlite://PATH or postgres://… (not changed).
    #[arg(long, value_name = "URL")]
    pub from: DatabaseUrl,
    /// The store to write, migrated first if needed.
    #[arg(long, value_name = "URL")]
    pub to: DatabaseUrl,
    /// Copy into a target that holds other users too (never one that holds
    /// any of the same users with other messages).
    #[arg(long)]
    pub merge: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    /// Only this tenant (API keys map to tenants; without keys it is `default`).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only this user of --tenant: one user's whole history.
    #[arg(long, requires = "tenant")]
    pub user: Option<String>,
}

#[derive(Debug, Clone, Args)]
pub struct ImportArgs {
    /// Import into a database that holds other users too (never over a
    /// user it holds with other messages).
    #[arg(long)]
    pub merge: bool,
}

/// The largest values the count and size settings accept: beyond them a
/// value is a mistake (or an attempt at "unlimited", which is `off`).
pub mod maximum {
    use std::time::Duration;

    pub const MAX_BATCH: u64 = 10_000;
    pub const MAX_MESSAGES_PER_USER: u64 = 100_000_000;
    pub const MAX_TRANSCRIPT_MESSAGES: u64 = 1_000_000;
    pub const MAX_BODY_BYTES: usize = 1 << 30;
    pub const MAX_IN_FLIGHT_BODY_BYTES: usize = 64 << 30;
    pub const DB_MAX_CONNECTIONS: u64 = 1_000;
    pub const COMMIT_BATCH: u64 = 10_000;
    pub const READ_CACHE_BYTES: usize = 64 << 30;
    pub const MAX_PAGE_BYTES: usize = 1 << 30;
    pub const WORKER_THREADS: u64 = 1_024;
    pub const MAX_CONNECTIONS: u64 = 1_000_000;
    pub const MAX_IN_FLIGHT: u64 = 1_000_000;
    /// Retention and the default window: a century.
    pub const AGE: Duration = Duration::from_secs(100 * 365 * 86_400);
    /// Timeouts and the cleanup interval: a day.
    pub const WAIT: Duration = Duration::from_secs(86_400);
}

/// The request-shaping settings of the service, as handlers and the
/// listener use them.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most messages one append may carry.
    pub max_batch: usize,
    /// Most messages one transcript save may carry.
    pub max_transcript_messages: usize,
    /// Oldest messages are evicted past this many per user.
    pub max_messages_per_user: Option<u64>,
    /// The age window of a history read that names no `max_age`.
    pub default_window: Option<Duration>,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// The bodies of all requests in flight, and of the answers over 64 KiB
    /// not yet sent, together, in bytes.
    pub max_in_flight_body_bytes: usize,
    /// A request still running after this gets a 503, so shutdown cannot hang;
    /// a client that takes none of its answer for this long is disconnected.
    pub request_timeout: Duration,
    /// A request head must arrive within this; idle keep-alive connections
    /// are closed after it too.
    pub header_timeout: Duration,
    /// Open client connections.
    pub max_connections: usize,
    /// Requests being handled at once.
    pub max_in_flight: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_batch: 1000,
            max_transcript_messages: 10_000,
            max_messages_per_user: None,
            default_window: Some(Duration::from_secs(24 * 60 * 60)),
            max_body_bytes: 8 * 1024 * 1024,
            max_in_flight_body_bytes: 256 * 1024 * 1024,
            request_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_in_flight: 512,
        }
    }
}

#[derive(Clone, Args)]
pub struct Config {
    /// Where messages live: `sqlite://PATH` (created on first start) or
    /// `postgres://USER:PASSWORD@HOST:PORT/DB`, with libpq's `sslmode`,
    /// `sslrootcert`, `sslcert`, `sslkey`, and `pool_mode=transaction` behind
    /// PgBouncer in transaction mode.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "sqlite://chat-history.db",
        hide_env_values = true,
        hide_default_value = false,
        global = true
    )]
    pub database_url: DatabaseUrl,

    /// Address and port to listen on.
    #[arg(
        long,
        env = "CHAT_HISTORY_BIND",
        default_value = "127.0.0.1:8080",
        global = true
    )]
    pub bind: SocketAddr,

    /// Delete messages older than this (`30d`, `12h`, …; at most 100 years), or `off`.
    #[arg(
        long,
        env = "CHAT_HISTORY_RETENTION",
        default_value = "30d",
        value_parser = OrOff::parser(Seconds::parser(maximum::AGE)),
        global = true
    )]
    pub retention: OrOff<Seconds>,

    /// How often the retention task runs (at most 1d).
    #[arg(
        long,
        env = "CHAT_HISTORY_CLEANUP_INTERVAL",
        default_value = "5m",
        value_parser = Seconds::parser(maximum::WAIT),
        global = true
    )]
    pub cleanup_interval: Seconds,

    /// The age window of a history read without `max_age` (at most 100
    /// years), or `off`.
    #[arg(
        long,
        env = "CHAT_HISTORY_DEFAULT_WINDOW",
        default_value = "24h",
        value_parser = OrOff::parser(Seconds::parser(maximum::AGE)),
        global = true
    )]
    pub default_window: OrOff<Seconds>,

    /// Keep at most this many messages per user, evicting the oldest (at
    /// most 100000000), or `off`.
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_MESSAGES_PER_USER",
        default_value = "off",
        value_parser = OrOff::parser(Count::parser(maximum::MAX_MESSAGES_PER_USER)),
        global = true
    )]
    pub max_messages_per_user: OrOff<Count>,

    /// Most messages one append may carry (at most 10000).
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_BATCH",
        default_value = "1000",
        value_parser = Count::parser(maximum::MAX_BATCH),
        global = true
    )]
    pub max_batch: Count,

    /// Most messages one transcript save may carry (at most 1000000).
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_TRANSCRIPT_MESSAGES",
        default_value = "10000",
        value_parser = Count::parser(maximum::MAX_TRANSCRIPT_MESSAGES),
        global = true
    )]
    pub max_transcript_messages: Count,

    /// Largest request body accepted: bytes, or with KiB/MiB/GiB (at most 1GiB).
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_BODY_BYTES",
        default_value = "8MiB",
        value_parser = ByteSize::parser(maximum::MAX_BODY_BYTES),
        global = true
    )]
    pub max_body_bytes: ByteSize,

    /// The bodies of all requests in flight, and of the answers over 64 KiB
    /// not yet sent, together, at most (at most 64GiB); a request, or an
    /// answer to a read, that would go past it gets 503.
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES",
        default_value = "256MiB",
        value_parser = ByteSize::parser(maximum::MAX_IN_FLIGHT_BODY_BYTES),
        global = true
    )]
    pub max_in_flight_body_bytes: ByteSize,

    /// A request running longer than this gets a 503, and shutdown waits no
    /// longer; a client that takes none of its answer for this long is
    /// disconnected (at most 1d).
    #[arg(
        long,
        env = "CHAT_HISTORY_REQUEST_TIMEOUT",
        default_value = "30s",
        value_parser = Seconds::parser(maximum::WAIT),
        global = true
    )]
    pub request_timeout: Seconds,

    /// A request's head must arrive within this, and a keep-alive connection
    /// waiting this long for its next request is closed (at most 1d).
    #[arg(
        long,
        env = "CHAT_HISTORY_HEADER_TIMEOUT",
        default_value = "30s",
        value_parser = Seconds::parser(maximum::WAIT),
        global = true
    )]
    pub header_timeout: Seconds,

    /// Open client connections, at most (at most 1000000); past it a new
    /// connection gets 503 and is closed.
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_CONNECTIONS",
        default_value = "1024",
        value_parser = Count::parser(maximum::MAX_CONNECTIONS),
        global = true
    )]
    pub max_connections: Count,

    /// Requests being handled at once, at most (at most 1000000); past it
    /// a request gets 503.
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_IN_FLIGHT",
        default_value = "512",
        value_parser = Count::parser(maximum::MAX_IN_FLIGHT),
        global = true
    )]
    pub max_in_flight: Count,

    /// Database connections in the pool (SQLite: read connections; at most 1000).
    #[arg(
        long,
        env = "CHAT_HISTORY_DB_MAX_CONNECTIONS",
        default_value = "10",
        value_parser = Count::parser(maximum::DB_MAX_CONNECTIONS),
        global = true
    )]
    pub db_max_connections: Count,

    /// Appends written in one shared commit, at most (at most 10000). Appends
    /// that arrive while a commit is in flight share the next one; 1 commits
    /// each append alone and reads each user's page alone (for Citus).
    #[arg(
        long,
        env = "CHAT_HISTORY_COMMIT_BATCH",
        default_value = "256",
        value_parser = Count::parser(maximum::COMMIT_BATCH),
        global = true
    )]
    pub commit_batch: Count,

    /// Postgres: the newest page of each user that reads found, kept to
    /// check against the user's `version` in the next read's statement (a
    /// page still current is not read again): bytes, or with KiB/MiB/GiB
    /// (at most 64GiB), or `off`.
    #[arg(
        long,
        env = "CHAT_HISTORY_READ_CACHE_BYTES",
        default_value = "64MiB",
        value_parser = OrOff::parser(ByteSize::parser(maximum::READ_CACHE_BYTES)),
        global = true
    )]
    pub read_cache_bytes: OrOff<ByteSize>,

    /// The bodies of one history page, at most: bytes, or with
    /// KiB/MiB/GiB (at most 1GiB). A page whose messages would take more
    /// ends early with `has_more: true` (it always holds at least one).
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_PAGE_BYTES",
        default_value = "4MiB",
        value_parser = ByteSize::parser(maximum::MAX_PAGE_BYTES),
        global = true
    )]
    pub max_page_bytes: ByteSize,

    /// Threads that serve requests (at most 1024). Default: tokio's own
    /// `TOKIO_WORKER_THREADS` when it holds such a count, else one per CPU
    /// this process may use.
    #[arg(
        long,
        env = "CHAT_HISTORY_WORKER_THREADS",
        value_parser = Count::parser(maximum::WORKER_THREADS),
        global = true
    )]
    pub worker_threads: Option<Count>,

    /// API keys, comma-separated `tenant:role:key` entries (role `user` or
    /// `admin`). With keys, every /v1 request needs `Authorization: Bearer <key>`.
    #[arg(
        long,
        env = "CHAT_HISTORY_API_KEYS",
        hide_env_values = true,
        global = true
    )]
    pub api_keys: Option<String>,

    /// A file of API keys: one `tenant:role:key` per line; blank lines and
    /// lines starting with `#` are ignored.
    #[arg(long, env = "CHAT_HISTORY_API_KEYS_FILE", global = true)]
    pub api_keys_file: Option<PathBuf>,

    /// Serve without API keys on an address other than loopback.
    #[arg(long, env = "CHAT_HISTORY_ALLOW_UNAUTHENTICATED", global = true)]
    pub allow_unauthenticated: bool,

    /// Require an API key (of any role) for `/metrics` too.
    #[arg(long, env = "CHAT_HISTORY_METRICS_REQUIRE_KEY", global = true)]
    pub metrics_require_key: bool,

    /// Requests per API key: `100/s`, `6000/m`, `50000/h`, or `off`.
    #[arg(
        long,
        env = "CHAT_HISTORY_RATE_LIMIT",
        default_value = "off",
        global = true
    )]
    pub rate_limit: OrOff<Rate>,

    /// Log format: `pretty` for a terminal, `json` for machines.
    #[arg(
        long,
        env = "CHAT_HISTORY_LOG_FORMAT",
        default_value = "pretty",
        global = true
    )]
    pub log_format: LogFormat,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &self.database_url)
            .field("bind", &self.bind)
            .field("retention", &self.retention)
            .field("cleanup_interval", &self.cleanup_interval)
            .field("default_window", &self.default_window)
            .field("max_messages_per_user", &self.max_messages_per_user)
            .field("max_batch", &self.max_batch)
            .field("max_transcript_messages", &self.max_transcript_messages)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_in_flight_body_bytes", &self.max_in_flight_body_bytes)
            .field("request_timeout", &self.request_timeout)
            .field("header_timeout", &self.header_timeout)
            .field("max_connections", &self.max_connections)
            .field("max_in_flight", &self.max_in_flight)
            .field("db_max_connections", &self.db_max_connections)
            .field("commit_batch", &self.commit_batch)
            .field("read_cache_bytes", &self.read_cache_bytes)
            .field("max_page_bytes", &self.max_page_bytes)
            .field("worker_threads", &self.worker_threads)
            .field("api_keys", &self.api_keys.as_ref().map(|_| "***"))
            .field("api_keys_file", &self.api_keys_file)
            .field("allow_unauthenticated", &self.allow_unauthenticated)
            .field("rate_limit", &self.rate_limit)
            .field("metrics_require_key", &self.metrics_require_key)
            .field("log_format", &self.log_format)
            .finish()
    }
}

impl Config {
    /// The limits, checked against each other: the in-flight budget must
    /// hold at least one request of the largest size.
    pub fn limits(&self) -> Result<Limits, String> {
        if self.max_in_flight_body_bytes.0 < self.max_body_bytes.0 {
            return Err(format!(
                "CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES ({} bytes) is below CHAT_HISTORY_MAX_BODY_BYTES \
                 ({} bytes): no request of the largest size could ever be served",
                self.max_in_flight_body_bytes.0, self.max_body_bytes.0
            ));
        }
        Ok(Limits {
            max_batch: to_usize(self.max_batch.0),
            max_transcript_messages: to_usize(self.max_transcript_messages.0),
            max_messages_per_user: self.max_messages_per_user.0.map(|c| c.0),
            default_window: self.default_window.0.map(|s| s.0),
            max_body_bytes: self.max_body_bytes.0,
            max_in_flight_body_bytes: self.max_in_flight_body_bytes.0,
            request_timeout: self.request_timeout.0,
            header_timeout: self.header_timeout.0,
            max_connections: to_usize(self.max_connections.0),
            max_in_flight: to_usize(self.max_in_flight.0),
        })
    }

    /// The configured keys (none: the service is open), and warnings to log.
    /// Errors name the variable and the entry, never the key.
    pub fn access(&self) -> Result<(Access, Vec<String>), String> {
        let (access, warnings) = self.keys()?;
        if self.metrics_require_key {
            Ok((access.protecting_metrics()?, warnings))
        } else {
            Ok((access, warnings))
        }
    }

    fn keys(&self) -> Result<(Access, Vec<String>), String> {
        let rate = self.rate_limit.0;
        match (&self.api_keys, &self.api_keys_file) {
            (Some(_), Some(_)) => {
                Err("set CHAT_HISTORY_API_KEYS or CHAT_HISTORY_API_KEYS_FILE, not both".into())
            }
            (Some(list), None) => Access::from_entries(
                list.split(',').filter(|e| !e.trim().is_empty()),
                |i| format!("CHAT_HISTORY_API_KEYS entry {}", i + 1),
                rate,
            ),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!(
                        "cannot read CHAT_HISTORY_API_KEYS_FILE {}: {e}",
                        path.display()
                    )
                })?;
                let lines: Vec<(usize, &str)> = text
                    .lines()
                    .enumerate()
                    .filter(|(_, line)| {
                        let line = line.trim();
                        !line.is_empty() && !line.starts_with('#')
                    })
                    .collect();
                Access::from_entries(
                    lines.iter().map(|(_, line)| *line),
                    |i| format!("CHAT_HISTORY_API_KEYS_FILE line {}", lines[i].0 + 1),
                    rate,
                )
            }
            (None, None) => Ok((Access::open(), Vec::new())),
        }
    }

    pub fn connect_options(&self) -> ConnectOptions {
        ConnectOptions {
            max_connections: u32::try_from(self.db_max_connections.0).unwrap_or(u32::MAX),
            commit_batch: to_usize(self.commit_batch.0),
            read_cache_bytes: self.read_cache_bytes.0.map_or(0, |b| b.0),
            page_bytes: self.max_page_bytes.0,
            ..ConnectOptions::default()
        }
    }
}

/// A count setting as `usize`; the maxima above all fit.
fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// The environment variable behind a malformed value, when the value came
/// from one: clap's own message names only the flag.
pub fn environment_source(error: &clap::Error) -> Option<String> {
    let clap::error::ContextValue::String(flag) =
        error.get(clap::error::ContextKind::InvalidArg)?
    else {
        return None;
    };
    let long = flag.strip_prefix("--")?.split([' ', '=']).next()?;
    let given_as_flag = std::env::args_os().any(|a| {
        let a = a.to_string_lossy();
        a == format!("--{long}") || a.starts_with(&format!("--{long}="))
    });
    if given_as_flag {
        return None;
    }
    let command = Cli::command();
    let env = command
        .get_arguments()
        .find(|arg| arg.get_long() == Some(long))?
        .get_env()?
        .to_string_lossy()
        .into_owned();
    std::env::var_os(&env).is_some().then_some(env)
}

/// Variables read by the service besides its settings.
const OTHER_VARIABLES: &[&str] = &["RUST_LOG"];

/// Looks at the whole environment before the settings are parsed. A variable
/// of ours that is not UTF-8 is an error naming it. A `CHAT_HISTORY_*`
/// variable that no setting reads gets a warning naming the closest setting
/// (returned, to be logged), except Kubernetes' service links
/// (`CHAT_HISTORY_SERVICE_*`, `CHAT_HISTORY_PORT*`), which are expected in a
/// pod next to a Service named `chat-history` and are passed over in silence.
/// Anything else, UTF-8 or not, is none of our business.
pub fn check_environment(
    vars: impl Iterator<Item = (OsString, OsString)>,
) -> Result<Vec<String>, String> {
    let command = Cli::command();
    let known: Vec<String> = command
        .get_arguments()
        .filter_map(|arg| arg.get_env())
        .map(|env| env.to_string_lossy().into_owned())
        .chain(OTHER_VARIABLES.iter().map(|name| (*name).to_string()))
        .collect();
    let mut unknown = Vec::new();
    for (name, value) in vars {
        // Our names are ASCII: a name that is not UTF-8 is someone else's.
        let Some(name) = name.to_str() else { continue };
        if known.iter().any(|k| k == name) {
            if value.to_str().is_none() {
                return Err(format!(
                    "the environment variable {name} is not valid UTF-8; set it to a UTF-8 value or unset it"
                ));
            }
            continue;
        }
        let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        if rest.starts_with("SERVICE_") || rest.starts_with("PORT") {
            continue;
        }
        unknown.push(name.to_string());
    }
    unknown.sort();
    let settings: Vec<&str> = known
        .iter()
        .map(String::as_str)
        .filter(|n| n.starts_with(ENV_PREFIX))
        .collect();
    Ok(unknown
        .into_iter()
        .map(|name| {
            let closest = settings
                .iter()
                .min_by_key(|setting| strsim::levenshtein(setting, &name))
                .copied()
                .unwrap_or_default();
            format!("ignoring {name}, which no setting reads; did you mean {closest}?")
        })
        .collect())
}

/// A setting that may be `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrOff<T>(pub Option<T>);

impl<T> OrOff<T> {
    /// A clap value parser: `off`, or what `inner` accepts.
    fn parser(
        inner: impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static,
    ) -> impl Fn(&str) -> Result<Self, String> + Clone + Send + Sync + 'static {
        move |s: &str| {
            if s.trim().eq_ignore_ascii_case("off") {
                Ok(Self(None))
            } else {
                inner(s)
                    .map(|v| Self(Some(v)))
                    .map_err(|e| format!("{e}, or `off`"))
            }
        }
    }
}

impl<T: FromStr<Err = String>> FromStr for OrOff<T> {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("off") {
            Ok(Self(None))
        } else {
            T::from_str(s)
                .map(|v| Self(Some(v)))
                .map_err(|e| format!("{e}, or `off`"))
        }
    }
}

/// A duration written like `30d`, `5m` or `90s`; at least one second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seconds(pub Duration);

impl Seconds {
    /// A clap value parser for durations from 1s to `max`.
    fn parser(max: Duration) -> impl Fn(&str) -> Result<Self, String> + Clone + Send + Sync {
        move |s: &str| {
            let duration = humantime::parse_duration(s.trim())
                .map_err(|e| format!("{e}: expected a duration like 30d, 12h, 5m or 90s"))?;
            if duration < Duration::from_secs(1) {
                return Err("must be at least 1s".into());
            }
            if duration > max {
                return Err(format!(
                    "must be at most {}",
                    humantime::format_duration(max)
                ));
            }
            Ok(Self(duration))
        }
    }
}

/// A whole number of at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count(pub u64);

impl Count {
    /// A clap value parser for whole numbers from 1 to `max`.
    fn parser(max: u64) -> impl Fn(&str) -> Result<Self, String> + Clone + Send + Sync {
        move |s: &str| match s.trim().parse::<u64>() {
            Ok(n) if (1..=max).contains(&n) => Ok(Self(n)),
            _ => Err(format!("expected a whole number from 1 to {max}")),
        }
    }
}

/// How many threads serve requests: the setting, else tokio's own
/// `TOKIO_WORKER_THREADS` when it holds a count from 1 to 1024, else `cpus`.
/// tokio would panic at start-up on any other value of its variable (`0`,
/// `abc`) or try to start that many threads (`99999999`); here such a value
/// is passed over with the warning returned.
pub fn worker_threads(
    setting: Option<Count>,
    tokio_variable: Option<OsString>,
    cpus: usize,
) -> (usize, Option<String>) {
    let cpus = cpus.max(1);
    if let Some(Count(n)) = setting {
        return (to_usize(n), None);
    }
    let Some(value) = tokio_variable else {
        return (cpus, None);
    };
    let parsed = value.to_str().and_then(|v| v.trim().parse::<u64>().ok());
    match parsed {
        Some(n) if (1..=maximum::WORKER_THREADS).contains(&n) => (to_usize(n), None),
        _ => (
            cpus,
            Some(format!(
                "TOKIO_WORKER_THREADS={} is not a thread count from 1 to {}; it is passed over, \
                 and {cpus} threads serve requests (CHAT_HISTORY_WORKER_THREADS sets them)",
                value.to_string_lossy(),
                maximum::WORKER_THREADS,
            )),
        ),
    }
}

/// A size in bytes: `8388608`, `512KiB`, `8MiB`, `1GiB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub usize);

impl ByteSize {
    /// A clap value parser for sizes from 1 byte to `max`.
    fn parser(max: usize) -> impl Fn(&str) -> Result<Self, String> + Clone + Send + Sync {
        move |s: &str| {
            let s = s.trim();
            let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            let (number, unit) = s.split_at(split);
            let multiplier: usize = match unit.trim() {
                "" | "B" => 1,
                "KiB" => 1 << 10,
                "MiB" => 1 << 20,
                "GiB" => 1 << 30,
                _ => {
                    return Err(
                        "expected bytes, optionally with KiB, MiB or GiB (like 8MiB)".into(),
                    )
                }
            };
            number
                .parse::<usize>()
                .ok()
                .and_then(|n| n.checked_mul(multiplier))
                .filter(|n| (1..=max).contains(n))
                .map(Self)
                .ok_or_else(|| format!("expected a size from 1 byte to {max} bytes, like 8MiB"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> Result<Config, String> {
        let mut all = vec!["chat-history"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all)
            .map(|cli| cli.config)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn durations_read_like_the_spec_writes_them() {
        let seconds = Seconds::parser(maximum::AGE);
        assert_eq!(seconds("30d").unwrap().0, Duration::from_secs(30 * 86_400));
        assert_eq!(seconds("5m").unwrap().0, Duration::from_secs(300));
        assert_eq!(seconds("90s").unwrap().0, Duration::from_secs(90));
        assert!(seconds("0s").is_err());
        assert!(seconds("soon").is_err());
        assert_eq!(OrOff::parser(seconds)("off").unwrap(), OrOff(None));
    }

    #[test]
    fn sizes_and_counts() {
        let size = ByteSize::parser(maximum::MAX_BODY_BYTES);
        assert_eq!(size("8MiB").unwrap().0, 8 << 20);
        assert_eq!(size("1024").unwrap().0, 1024);
        assert!(size("8MB").is_err());
        assert!(size("2GiB").is_err());
        let count = Count::parser(10);
        assert!(count("0").is_err());
        assert!(count("11").is_err());
        assert_eq!(count("10").unwrap().0, 10);
        assert_eq!(OrOff::parser(count)("off").unwrap(), OrOff(None));
    }

    #[test]
    fn every_count_size_and_duration_has_a_maximum() {
        for (flag, too_big) in [
            ("--max-messages-per-user", "18446744073709551615"),
            ("--max-messages-per-user", "100000001"),
            ("--max-batch", "10001"),
            ("--worker-threads", "1025"),
            ("--max-transcript-messages", "1000001"),
            ("--max-body-bytes", "2GiB"),
            ("--max-in-flight-body-bytes", "65GiB"),
            ("--db-max-connections", "1001"),
            ("--commit-batch", "10001"),
            ("--read-cache-bytes", "65GiB"),
            ("--max-page-bytes", "2GiB"),
            ("--max-connections", "1000001"),
            ("--max-in-flight", "1000001"),
            ("--retention", "101years"),
            ("--default-window", "101years"),
            ("--cleanup-interval", "2d"),
            ("--request-timeout", "2d"),
            ("--header-timeout", "2d"),
        ] {
            let error = config(&[flag, too_big]).unwrap_err();
            assert!(
                error.contains(flag) && (error.contains("at most") || error.contains(" to ")),
                "{flag}: {error}"
            );
        }
        assert_eq!(
            config(&["--max-messages-per-user", "off"])
                .unwrap()
                .max_messages_per_user,
            OrOff(None)
        );
    }

    #[test]
    fn the_read_cache_is_64_mib_unless_set_and_off_keeps_none() {
        let bytes = |args: &[&str]| config(args).unwrap().connect_options().read_cache_bytes;
        assert_eq!(bytes(&[]), 64 << 20);
        assert_eq!(bytes(&["--read-cache-bytes", "1GiB"]), 1 << 30);
        assert_eq!(bytes(&["--read-cache-bytes", "off"]), 0);
        assert_eq!(ConnectOptions::default().read_cache_bytes, bytes(&[]));
    }

    #[test]
    fn a_page_holds_4_mib_of_bodies_unless_set() {
        let bytes = |args: &[&str]| config(args).unwrap().connect_options().page_bytes;
        assert_eq!(bytes(&[]), 4 << 20);
        assert_eq!(bytes(&["--max-page-bytes", "64KiB"]), 64 << 10);
        assert_eq!(ConnectOptions::default().page_bytes, bytes(&[]));
        assert!(config(&["--max-page-bytes", "0"]).is_err());
        assert!(config(&["--max-page-bytes", "2GiB"]).is_err());
    }

    #[test]
    fn the_body_budget_must_hold_one_body() {
        let error = config(&[
            "--max-body-bytes",
            "64MiB",
            "--max-in-flight-body-bytes",
            "32MiB",
        ])
        .unwrap()
        .limits()
        .unwrap_err();
        assert!(
            error.contains("CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES"),
            "{error}"
        );
    }

    #[test]
    fn defaults_match_the_spec() {
        let config = config(&[]).unwrap();
        let limits = config.limits().unwrap();
        assert_eq!(config.database_url.redacted(), "sqlite://chat-history.db");
        assert_eq!(config.bind.to_string(), "127.0.0.1:8080");
        assert_eq!(limits.max_batch, 1000);
        assert_eq!(limits.max_body_bytes, 8 << 20);
        assert_eq!(limits.default_window, Some(Duration::from_secs(86_400)));
        assert_eq!(limits.max_messages_per_user, None);
        assert_eq!(
            config.retention.0.unwrap().0,
            Duration::from_secs(30 * 86_400)
        );
        assert_eq!(config.cleanup_interval.0, Duration::from_secs(300));
        let defaults = Limits::default();
        assert_eq!(
            limits.max_transcript_messages,
            defaults.max_transcript_messages
        );
        assert_eq!(
            limits.max_in_flight_body_bytes,
            defaults.max_in_flight_body_bytes
        );
        assert_eq!(limits.header_timeout, defaults.header_timeout);
        assert_eq!(limits.max_connections, defaults.max_connections);
        assert_eq!(limits.max_in_flight, defaults.max_in_flight);
    }

    #[test]
    fn malformed_values_name_the_setting() {
        let error = config(&["--max-batch", "lots"]).unwrap_err();
        assert!(error.contains("--max-batch"), "{error}");
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
        pairs
            .iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v)))
            .collect()
    }

    #[test]
    fn unknown_chat_history_variables_are_warned_about_with_the_closest_setting() {
        let warnings = check_environment(
            env(&[
                ("CHAT_HISTORY_RETENSION", "1d"),
                ("CHAT_HISTORY_BIND", "x"),
                ("HOME", "/root"),
            ])
            .into_iter(),
        )
        .unwrap();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("CHAT_HISTORY_RETENSION"),
            "{warnings:?}"
        );
        assert!(
            warnings[0].contains("did you mean CHAT_HISTORY_RETENTION?"),
            "{warnings:?}"
        );
        assert!(check_environment(std::iter::empty()).unwrap().is_empty());
    }

    #[test]
    fn kubernetes_service_links_pass_in_silence() {
        let warnings = check_environment(
            env(&[
                ("CHAT_HISTORY_SERVICE_HOST", "10.0.0.1"),
                ("CHAT_HISTORY_SERVICE_PORT", "8080"),
                ("CHAT_HISTORY_SERVICE_PORT_HTTP", "8080"),
                ("CHAT_HISTORY_PORT", "tcp://10.0.0.1:8080"),
                ("CHAT_HISTORY_PORT_8080_TCP_ADDR", "10.0.0.1"),
            ])
            .into_iter(),
        )
        .unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[cfg(unix)]
    #[test]
    fn variables_that_are_not_utf8_fail_only_when_they_are_ours() {
        use std::os::unix::ffi::OsStringExt;
        let bad = || OsString::from_vec(vec![0xff, 0xfe]);
        let foreign = vec![
            (OsString::from("LANG_OF_SOMEONE_ELSE"), bad()),
            (bad(), OsString::from("x")),
        ];
        assert!(check_environment(foreign.into_iter()).unwrap().is_empty());
        for ours in ["CHAT_HISTORY_BIND", "DATABASE_URL", "RUST_LOG"] {
            let error =
                check_environment(vec![(OsString::from(ours), bad())].into_iter()).unwrap_err();
            assert!(error.contains(ours) && error.contains("UTF-8"), "{error}");
        }
    }

    #[test]
    fn keys_come_from_the_list_or_the_file_never_echoed() {
        let parse = |args: &[&str]| {
            let mut all = vec!["chat-history"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all).unwrap().config.access()
        };
        let (access, _) = parse(&[
            "--api-keys",
            "a:user:k1-0123456789abcdef, b:admin:k2-0123456789abcdef",
        ])
        .unwrap();
        assert!(!access.is_open());
        let error = parse(&[
            "--api-keys",
            "a:user:k1-0123456789abcdef,b:boss:hunter2-hunter2-hunter2",
        ])
        .unwrap_err();
        assert!(
            error.starts_with("CHAT_HISTORY_API_KEYS entry 2 is malformed"),
            "{error}"
        );
        assert!(!error.contains("hunter2"), "{error}");

        let file = std::env::temp_dir().join(format!("chat-history-keys-{}", std::process::id()));
        std::fs::write(
            &file,
            "# keys\n\na:user:k1-0123456789abcdef\n  \nb:root:hunter2-hunter2\n",
        )
        .unwrap();
        let error = parse(&["--api-keys-file", file.to_str().unwrap()]).unwrap_err();
        assert!(
            error.starts_with("CHAT_HISTORY_API_KEYS_FILE line 5 is malformed"),
            "{error}"
        );
        assert!(!error.contains("hunter2"), "{error}");
        std::fs::write(&file, "# keys\na:user:k1-0123456789abcdef\n").unwrap();
        let (access, _) = parse(&["--api-keys-file", file.to_str().unwrap()]).unwrap();
        assert!(!access.is_open());
        std::fs::remove_file(&file).unwrap();

        let cli =
            Cli::try_parse_from(["chat-history", "--api-keys", "a:user:hunter2-hunter2"]).unwrap();
        assert!(!format!("{:?}", cli.config).contains("hunter2"));
        assert!(parse(&[]).unwrap().0.is_open());
    }

    #[test]
    fn debug_hides_the_database_password() {
        for url in [
            "postgres://app:hunter2@db/chat",
            "postgres://app@db/chat?password=hunter2",
            "postgres://app@db/chat?pass%77ord=hunter2",
            "postgres://app:hunter%32@db/chat",
        ] {
            let config = config(&["--database-url", url]).unwrap();
            let shown = format!("{config:?}");
            assert!(!shown.contains("hunter"), "{shown}");
        }
    }

    #[test]
    fn a_tokio_worker_threads_that_tokio_would_panic_on_is_passed_over() {
        let tokio = |v: &str| Some(OsString::from(v));
        assert_eq!(worker_threads(None, None, 2), (2, None));
        assert_eq!(worker_threads(None, tokio("3"), 2), (3, None));
        assert_eq!(worker_threads(Some(Count(1)), tokio("abc"), 2), (1, None));
        for bad in ["0", "abc", "99999999", "-1", ""] {
            let (threads, warning) = worker_threads(None, tokio(bad), 2);
            assert_eq!(threads, 2, "{bad}");
            let warning = warning.unwrap_or_default();
            assert!(
                warning.starts_with(&format!("TOKIO_WORKER_THREADS={bad} is not")),
                "{warning}"
            );
        }
        assert_eq!(worker_threads(None, None, 0), (1, None));
        assert!(config(&["--worker-threads", "0"]).is_err());
        assert_eq!(
            config(&["--worker-threads", "4"]).unwrap().worker_threads,
            Some(Count(4))
        );
    }
}
