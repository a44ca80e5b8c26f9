//! Command line and environment: every setting is a flag with an environment
//! fallback. Malformed values, and `CHAT_HISTORY_*` variables that name no
//! setting, stop start-up with a message that names the setting.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};

use crate::api::Limits;
use crate::auth::{Access, Rate};
use crate::store::{redact_url, ConnectOptions};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Subcommand)]
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
}

#[derive(Clone, Args)]
pub struct Config {
    /// Where messages live: `sqlite://PATH` (created on first start) or
    /// `postgres://USER:PASSWORD@HOST:PORT/DB`.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "sqlite://chat-history.db",
        hide_env_values = true,
        global = true
    )]
    pub database_url: String,

    /// Address and port to listen on.
    #[arg(
        long,
        env = "CHAT_HISTORY_BIND",
        default_value = "127.0.0.1:8080",
        global = true
    )]
    pub bind: SocketAddr,

    /// Delete messages older than this (`30d`, `12h`, …), or `off`.
    #[arg(
        long,
        env = "CHAT_HISTORY_RETENTION",
        default_value = "30d",
        global = true
    )]
    pub retention: OrOff<Seconds>,

    /// How often the retention task runs.
    #[arg(
        long,
        env = "CHAT_HISTORY_CLEANUP_INTERVAL",
        default_value = "5m",
        global = true
    )]
    pub cleanup_interval: Seconds,

    /// The age window of a history read without `max_age`, or `off`.
    #[arg(
        long,
        env = "CHAT_HISTORY_DEFAULT_WINDOW",
        default_value = "24h",
        global = true
    )]
    pub default_window: OrOff<Seconds>,

    /// Keep at most this many messages per user, evicting the oldest, or `off`.
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_MESSAGES_PER_USER",
        default_value = "off",
        global = true
    )]
    pub max_messages_per_user: OrOff<Count>,

    /// Most messages one append may carry.
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_BATCH",
        default_value = "1000",
        global = true
    )]
    pub max_batch: Count,

    /// Largest request body accepted: bytes, or with KiB/MiB/GiB.
    #[arg(
        long,
        env = "CHAT_HISTORY_MAX_BODY_BYTES",
        default_value = "8MiB",
        global = true
    )]
    pub max_body_bytes: ByteSize,

    /// A request running longer than this gets a 503 (and shutdown waits no longer).
    #[arg(
        long,
        env = "CHAT_HISTORY_REQUEST_TIMEOUT",
        default_value = "30s",
        global = true
    )]
    pub request_timeout: Seconds,

    /// Database connections in the pool (SQLite: read connections).
    #[arg(
        long,
        env = "CHAT_HISTORY_DB_MAX_CONNECTIONS",
        default_value = "10",
        global = true
    )]
    pub db_max_connections: Count,

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
            .field("database_url", &redact_url(&self.database_url))
            .field("bind", &self.bind)
            .field("retention", &self.retention)
            .field("cleanup_interval", &self.cleanup_interval)
            .field("default_window", &self.default_window)
            .field("max_messages_per_user", &self.max_messages_per_user)
            .field("max_batch", &self.max_batch)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("request_timeout", &self.request_timeout)
            .field("db_max_connections", &self.db_max_connections)
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
    pub fn limits(&self) -> Limits {
        Limits {
            max_batch: self.max_batch.0 as usize,
            max_messages_per_user: self.max_messages_per_user.0.map(|c| c.0),
            default_window: self.default_window.0.map(|s| s.0),
            max_body_bytes: self.max_body_bytes.0,
            request_timeout: self.request_timeout.0,
        }
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
            ..ConnectOptions::default()
        }
    }
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
    let given_as_flag =
        std::env::args().any(|a| a == format!("--{long}") || a.starts_with(&format!("--{long}=")));
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

/// Fails on a `CHAT_HISTORY_*` variable that no setting reads: a typo there
/// would otherwise be ignored silently.
pub fn check_environment(vars: impl Iterator<Item = (String, String)>) -> Result<(), String> {
    let command = Cli::command();
    let known: Vec<String> = command
        .get_arguments()
        .filter_map(|arg| arg.get_env())
        .map(|env| env.to_string_lossy().into_owned())
        .collect();
    let mut unknown: Vec<String> = vars
        .map(|(name, _)| name)
        .filter(|name| name.starts_with(ENV_PREFIX) && !known.contains(name))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort();
    let known: Vec<&str> = known
        .iter()
        .map(String::as_str)
        .filter(|n| n.starts_with(ENV_PREFIX))
        .collect();
    Err(format!(
        "unknown setting {}; the settings are {}",
        unknown.join(", "),
        known.join(", ")
    ))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Pretty,
    Json,
}

/// A setting that may be `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrOff<T>(pub Option<T>);

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

impl FromStr for Seconds {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let duration = humantime::parse_duration(s.trim())
            .map_err(|e| format!("{e}: expected a duration like 30d, 12h, 5m or 90s"))?;
        if duration < Duration::from_secs(1) {
            return Err("must be at least 1s".into());
        }
        Ok(Self(duration))
    }
}

/// A whole number of at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count(pub u64);

impl FromStr for Count {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().parse::<u64>() {
            Ok(n) if n >= 1 => Ok(Self(n)),
            _ => Err("expected a whole number of at least 1".into()),
        }
    }
}

/// A size in bytes: `8388608`, `512KiB`, `8MiB`, `1GiB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub usize);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (number, unit) = s.split_at(split);
        let multiplier: usize = match unit.trim() {
            "" | "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            _ => return Err("expected bytes, optionally with KiB, MiB or GiB (like 8MiB)".into()),
        };
        number
            .parse::<usize>()
            .ok()
            .and_then(|n| n.checked_mul(multiplier))
            .filter(|n| *n >= 1)
            .map(Self)
            .ok_or_else(|| "expected a size of at least 1 byte, like 8MiB".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_the_spec_writes_them() {
        assert_eq!(
            "30d".parse::<Seconds>().unwrap().0,
            Duration::from_secs(30 * 86_400)
        );
        assert_eq!("5m".parse::<Seconds>().unwrap().0, Duration::from_secs(300));
        assert_eq!("90s".parse::<Seconds>().unwrap().0, Duration::from_secs(90));
        assert!("0s".parse::<Seconds>().is_err());
        assert!("soon".parse::<Seconds>().is_err());
        assert_eq!("off".parse::<OrOff<Seconds>>().unwrap(), OrOff(None));
    }

    #[test]
    fn sizes_and_counts() {
        assert_eq!("8MiB".parse::<ByteSize>().unwrap().0, 8 << 20);
        assert_eq!("1024".parse::<ByteSize>().unwrap().0, 1024);
        assert!("8MB".parse::<ByteSize>().is_err());
        assert!("0".parse::<Count>().is_err());
        assert_eq!("off".parse::<OrOff<Count>>().unwrap(), OrOff(None));
    }

    #[test]
    fn defaults_match_the_spec() {
        let cli = Cli::try_parse_from(["chat-history"]).unwrap();
        let limits = cli.config.limits();
        assert_eq!(cli.config.database_url, "sqlite://chat-history.db");
        assert_eq!(cli.config.bind.to_string(), "127.0.0.1:8080");
        assert_eq!(limits.max_batch, 1000);
        assert_eq!(limits.max_body_bytes, 8 << 20);
        assert_eq!(limits.default_window, Some(Duration::from_secs(86_400)));
        assert_eq!(limits.max_messages_per_user, None);
        assert_eq!(
            cli.config.retention.0.unwrap().0,
            Duration::from_secs(30 * 86_400)
        );
        assert_eq!(cli.config.cleanup_interval.0, Duration::from_secs(300));
    }

    #[test]
    fn malformed_values_name_the_setting() {
        let error = Cli::try_parse_from(["chat-history", "--max-batch", "lots"])
            .unwrap_err()
            .to_string();
        assert!(error.contains("--max-batch"), "{error}");
    }

    #[test]
    fn unknown_chat_history_variables_are_refused() {
        let vars = [
            ("CHAT_HISTORY_RETENSION".to_string(), "1d".to_string()),
            ("CHAT_HISTORY_BIND".to_string(), "x".to_string()),
            ("HOME".to_string(), "/root".to_string()),
        ];
        let error = check_environment(vars.into_iter()).unwrap_err();
        assert!(
            error.starts_with("unknown setting CHAT_HISTORY_RETENSION;"),
            "{error}"
        );
        assert!(check_environment(std::iter::empty()).is_ok());
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
        let cli = Cli::try_parse_from([
            "chat-history",
            "--database-url",
            "postgres://app:hunter2@db/chat",
        ])
        .unwrap();
        let shown = format!("{:?}", cli.config);
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
