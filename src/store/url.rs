//! `DATABASE_URL` as a secret: the text is held in a `SecretString`, exposed
//! only to open the pools, and everything that prints it (`Display`,
//! `Debug`, errors, logs) prints the redacted form, whatever part of the URL
//! carries the password.

use std::fmt;
use std::str::FromStr;

use secrecy::{ExposeSecret, SecretString};
use url::Url;

/// What stands in for a secret in a printed URL.
const REDACTED: &str = "***";

/// The libpq parameters sqlx understands in a Postgres URL, with
/// the file parameters below; any other is dropped before sqlx sees it (sqlx would
/// log its value, which may be a secret such as `sslpassword`).
const POSTGRES_PARAMETERS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// How the server at the end of a Postgres URL hands out connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// Postgres itself, or a pooler that gives each client a server
    /// connection for the whole session: prepared statements and session
    /// locks work.
    Session,
    /// A pooler (PgBouncer, PgCat, Supavisor, …) that may hand each
    /// transaction to another server connection: statements go unnamed and
    /// inside transactions, and nothing outlives a transaction.
    Transaction,
}

/// A Postgres `DATABASE_URL` taken apart for the driver.
pub(super) struct PostgresUrl {
    /// What sqlx gets: the URL without the parameters it does not know.
    pub url: SecretString,
    /// The names of the parameters dropped, for a warning.
    pub dropped: Vec<String>,
    pub pool_mode: PoolMode,
    /// The files the URL names (`sslrootcert=PATH`, …): parameter and path.
    pub files: Vec<(String, String)>,
}

/// The parameters sqlx understands whose value is a file it reads when it
/// connects: a CA to trust, and a client certificate or its key.
const ROOT_CERTIFICATE_PARAMETERS: &[&str] = &["sslrootcert", "ssl-root-cert", "ssl-ca"];
const CLIENT_CERTIFICATE_PARAMETERS: &[&str] = &["sslcert", "ssl-cert", "sslkey", "ssl-key"];

fn is_file_parameter(name: &str) -> bool {
    ROOT_CERTIFICATE_PARAMETERS.contains(&name) || CLIENT_CERTIFICATE_PARAMETERS.contains(&name)
}

impl PostgresUrl {
    /// A clear error for a named file that cannot be read, now, rather than
    /// the driver's bare "No such file or directory" at the first connection.
    pub fn check_files(&self) -> Result<(), String> {
        for (parameter, path) in &self.files {
            if let Err(e) = std::fs::File::open(path) {
                return Err(format!(
                    "DATABASE_URL: {parameter} names {path:?}, which cannot be read: {e}"
                ));
            }
        }
        Ok(())
    }
}

/// libpq's client certificate variables, as sqlx reads them whatever the
/// URL says: `(PGSSLCERT, PGSSLKEY)`.
pub const CLIENT_CERTIFICATE_VARIABLES: [&str; 2] = ["PGSSLCERT", "PGSSLKEY"];

/// What a `PGSSLCERT` value is, as far as passing it over goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertificateFile {
    /// A file that is there, PEM text itself (sqlx takes that too), or a
    /// path that cannot be looked at for another reason (libpq refuses then).
    Usable,
    /// A path where nothing is (not found, or a parent that is not a folder).
    NotThere,
}

/// Whether `PGSSLCERT` and `PGSSLKEY` (`cert`, `key`) are a pair that libpq
/// would not use while sqlx refuses every TLS connection over them ("user
/// auth key and certs must be given together", or a bare "No such file or
/// directory"): a key alone (sqlx, unlike libpq, has no default certificate
/// in ~/.postgresql), an empty certificate, or a certificate file that is
/// not there (libpq then sends no certificate). When they are such a pair,
/// the warning to give on passing over both. A URL that names a client
/// certificate or key of its own (`url_names_one`) is left to the driver.
pub fn unused_client_certificate(
    cert: Option<&str>,
    key: Option<&str>,
    url_names_one: bool,
    look: impl Fn(&str) -> CertificateFile,
) -> Option<String> {
    if url_names_one {
        return None;
    }
    let pem = |c: &str| c.trim_start().starts_with("-----BEGIN");
    let with_key = if key.is_some() { " with PGSSLKEY" } else { "" };
    match (cert, key) {
        (None, None) => None,
        (None, Some(_)) => Some(
            "PGSSLKEY is set without PGSSLCERT: it is passed over, and no client certificate \
             is sent"
                .to_string(),
        ),
        (Some(""), _) => Some(format!(
            "PGSSLCERT is empty: it is passed over{with_key}, and no client certificate is sent"
        )),
        (Some(cert), _) if !pem(cert) && look(cert) == CertificateFile::NotThere => Some(format!(
            "PGSSLCERT names {cert:?}, where there is no file: it is passed over{with_key}, and \
             no client certificate is sent, as libpq does"
        )),
        (Some(_), _) => None,
    }
}

/// [`CertificateFile`] of a path, as libpq tells them apart.
pub fn certificate_file(path: &str) -> CertificateFile {
    match std::fs::metadata(path) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            CertificateFile::NotThere
        }
        _ => CertificateFile::Usable,
    }
}

/// A `DATABASE_URL`.
#[derive(Clone)]
pub struct DatabaseUrl(SecretString);

impl DatabaseUrl {
    pub fn new(url: &str) -> Self {
        Self(SecretString::from(url))
    }

    /// The URL itself, for the driver only.
    pub(super) fn expose(&self) -> &str {
        self.0.expose_secret()
    }

    /// Whether the URL names a client certificate or key of its own.
    pub fn names_client_certificate(&self) -> bool {
        Url::parse(self.expose()).is_ok_and(|url| {
            url.query_pairs()
                .any(|(k, _)| CLIENT_CERTIFICATE_PARAMETERS.contains(&&*k))
        })
    }

    pub fn is_postgres(&self) -> bool {
        let url = self.expose();
        url.starts_with("postgres://") || url.starts_with("postgresql://")
    }

    pub fn is_sqlite(&self) -> bool {
        self.expose().starts_with("sqlite:")
    }

    /// The file of an SQLite URL (`sqlite://PATH`, `sqlite:PATH`), without
    /// its `?…` options; `None` for other URLs and in-memory databases.
    pub fn sqlite_path(&self) -> Option<String> {
        let rest = self.expose().strip_prefix("sqlite:")?;
        let rest = rest.strip_prefix("//").unwrap_or(rest);
        let path = rest.split_once('?').map_or(rest, |(path, _)| path);
        (!path.is_empty() && !path.starts_with(":memory:")).then(|| path.to_owned())
    }

    /// The URL for sqlx's Postgres driver, without the parameters it does
    /// not know, and the names of those (never their values) for a warning.
    /// `pool_mode` is ours: it says how a pooler between us and Postgres
    /// hands out server connections (PgBouncer's name for it).
    pub(super) fn for_postgres(&self) -> Result<PostgresUrl, String> {
        let Ok(mut url) = Url::parse(self.expose()) else {
            return Ok(PostgresUrl {
                url: self.0.clone(),
                dropped: Vec::new(),
                pool_mode: PoolMode::Session,
                files: Vec::new(),
            });
        };
        let mut pool_mode = PoolMode::Session;
        let mut known = Vec::new();
        let mut dropped = Vec::new();
        let mut files = Vec::new();
        for (k, v) in url.query_pairs() {
            if k == "pool_mode" {
                pool_mode = match &*v {
                    "session" => PoolMode::Session,
                    "transaction" => PoolMode::Transaction,
                    other => {
                        return Err(format!(
                            "DATABASE_URL: pool_mode must be `session` (a direct connection, or a \
                             pooler in session mode) or `transaction` (PgBouncer and the like in \
                             transaction mode); got {other:?}"
                        ))
                    }
                };
            } else if is_file_parameter(&k) {
                files.push((k.clone().into_owned(), v.clone().into_owned()));
                known.push((k.into_owned(), v.into_owned()));
            } else if POSTGRES_PARAMETERS.contains(&&*k) || k.starts_with("options[") {
                known.push((k.into_owned(), v.into_owned()));
            } else {
                dropped.push(k.into_owned());
            }
        }
        if known.is_empty() {
            url.set_query(None);
        } else {
            url.query_pairs_mut().clear().extend_pairs(known);
        }
        Ok(PostgresUrl {
            url: SecretString::from(url.as_str()),
            dropped,
            pool_mode,
            files,
        })
    }

    /// The URL with every password replaced: in the user info, and in any
    /// query parameter whose (percent-decoded) name mentions a password.
    /// A URL that does not parse is shown by its scheme alone.
    pub fn redacted(&self) -> String {
        let text = self.expose();
        let Ok(mut url) = Url::parse(text) else {
            let scheme = text.split_once(':').map_or("", |(scheme, _)| scheme);
            let scheme: String = scheme
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
                .collect();
            return format!("{scheme}:(a URL that does not parse, not shown)");
        };
        if url.password().is_some() {
            let _ = url.set_password(Some(REDACTED));
        }
        if url.query().is_some() {
            let pairs: Vec<(String, String)> = url
                .query_pairs()
                .map(|(k, v)| {
                    let secret = k.to_ascii_lowercase().contains("pass");
                    let v = if secret {
                        REDACTED.into()
                    } else {
                        v.into_owned()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            url.query_pairs_mut().clear().extend_pairs(pairs);
        }
        url.set_fragment(None);
        url.into()
    }
}

impl FromStr for DatabaseUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(Self::new(s))
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DatabaseUrl({:?})", self.redacted())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        for (url, secret) in [
            ("postgres://app:s3cret@db:5432/chat", "s3cret"),
            ("postgres://app:s3cr%65t@db/chat", "s3cr"),
            ("postgres://app@db/chat?password=s3cret", "s3cret"),
            (
                "postgres://app@db/chat?sslmode=require&pass%77ord=s3cret",
                "s3cret",
            ),
            ("postgres://app@db/chat?sslpassword=s3cret", "s3cret"),
            ("postgres://app:s3cret@db:notaport/chat", "s3cret"),
            ("postgres://app:s3cret@[::1/chat", "s3cret"),
        ] {
            let url = DatabaseUrl::new(url);
            for shown in [url.to_string(), format!("{url:?}"), url.redacted()] {
                assert!(!shown.contains(secret), "{shown}");
            }
        }
    }

    #[test]
    fn the_rest_of_the_url_stays_readable() {
        assert_eq!(
            DatabaseUrl::new("postgres://app:s3cret@db:5432/chat?sslmode=verify-full").redacted(),
            "postgres://app:***@db:5432/chat?sslmode=verify-full"
        );
        assert_eq!(
            DatabaseUrl::new("postgres://app@db/chat").redacted(),
            "postgres://app@db/chat"
        );
        assert_eq!(
            DatabaseUrl::new("sqlite://chat.db").redacted(),
            "sqlite://chat.db"
        );
    }

    #[test]
    fn unknown_parameters_are_named_not_passed_on() {
        let url = DatabaseUrl::new("postgres://app@db/chat?sslmode=require&sslpassword=s3cret");
        let parts = url.for_postgres().unwrap();
        assert_eq!(parts.dropped, ["sslpassword"]);
        assert_eq!(
            parts.url.expose_secret(),
            "postgres://app@db/chat?sslmode=require"
        );
        assert_eq!(parts.pool_mode, PoolMode::Session);
    }

    #[test]
    fn a_client_certificate_that_libpq_would_not_use_is_passed_over() {
        let look = |path: &str| {
            if path == "/gone.crt" {
                CertificateFile::NotThere
            } else {
                CertificateFile::Usable
            }
        };
        let unused = |cert, key, url| unused_client_certificate(cert, key, url, look);
        assert_eq!(unused(None, None, false), None);
        assert_eq!(unused(Some("/there.crt"), Some("/k"), false), None);
        // With a certificate but no key, libpq refuses too: left to sqlx.
        assert_eq!(unused(Some("/there.crt"), None, false), None);
        // PEM text is a certificate to sqlx, whatever the file system says.
        assert_eq!(
            unused(Some("-----BEGIN CERTIFICATE-----\nMII"), None, false),
            None
        );
        // A URL with a certificate (or key) of its own decides.
        assert_eq!(unused(None, Some("/k"), true), None);
        assert_eq!(unused(Some("/gone.crt"), Some("/k"), true), None);
        for (cert, key, says) in [
            (None, Some("/k"), "PGSSLKEY is set without PGSSLCERT"),
            (
                Some(""),
                Some("/k"),
                "PGSSLCERT is empty: it is passed over with PGSSLKEY",
            ),
            (Some(""), None, "PGSSLCERT is empty: it is passed over,"),
            (
                Some("/gone.crt"),
                None,
                "PGSSLCERT names \"/gone.crt\", where there is no file",
            ),
            (Some("/gone.crt"), Some("/k"), "passed over with PGSSLKEY"),
        ] {
            let warning = unused(cert, key, false).unwrap_or_default();
            assert!(warning.contains(says), "{cert:?} {key:?}: {warning}");
        }
        assert_eq!(
            certificate_file("/nonexistent/x.crt"),
            CertificateFile::NotThere
        );
        assert_eq!(
            certificate_file("/etc/hostname/x.crt"),
            CertificateFile::NotThere
        );
        assert_eq!(certificate_file("/"), CertificateFile::Usable);
        assert!(
            DatabaseUrl::new("postgres://h/d?sslmode=require&sslkey=/k").names_client_certificate()
        );
        assert!(!DatabaseUrl::new("postgres://h/d?sslmode=require").names_client_certificate());
    }

    #[test]
    fn a_named_file_that_cannot_be_read_is_named() {
        let url = DatabaseUrl::new(
            "postgres://app:s3cret@db/chat?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        );
        let error = url.for_postgres().unwrap().check_files().unwrap_err();
        assert!(
            error.contains("sslrootcert") && error.contains("/nonexistent/ca.pem"),
            "{error}"
        );
        assert!(!error.contains("s3cret"), "{error}");
    }

    #[test]
    fn pool_mode_is_ours_and_not_passed_on() {
        let url = DatabaseUrl::new(
            "postgres://app@bouncer:6432/chat?pool_mode=transaction&sslmode=require",
        );
        let parts = url.for_postgres().unwrap();
        assert_eq!(parts.pool_mode, PoolMode::Transaction);
        assert!(parts.dropped.is_empty());
        assert_eq!(
            parts.url.expose_secret(),
            "postgres://app@bouncer:6432/chat?sslmode=require"
        );
        let wrong = DatabaseUrl::new("postgres://app:s3cret@bouncer/chat?pool_mode=statement");
        let error = wrong.for_postgres().err().unwrap();
        assert!(
            error.contains("pool_mode") && !error.contains("s3cret"),
            "{error}"
        );
    }
}
