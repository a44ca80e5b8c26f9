//! Access control: API keys (`tenant:role:key`), the middleware that turns
//! a bearer key into the request's tenant, and per-key rate limits.
//!
//! Keys are kept only as SHA-256 digests and compared in constant time
//! against every configured key, so neither a log line, a `Debug` print nor
//! the timing of a comparison gives one away.

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;

use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::domain::Tenant;
use crate::error::Problem;

/// Keys shorter than this are accepted with a warning.
const SHORT_KEY: usize = 16;
/// Longest tenant name, in bytes.
const TENANT_MAX_BYTES: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    User,
    Admin,
}

/// One configured key: whose it is and what it may do. The key itself is
/// not kept, only its digest.
struct ApiKey {
    tenant: Tenant,
    role: Role,
    digest: [u8; 32],
}

/// Requests allowed per key per period, as in `100/s` or `6000/m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate(Quota);

impl FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let malformed = || "expected requests per period like 100/s, 6000/m or 50000/h".to_string();
        let (count, period) = s.trim().split_once('/').ok_or_else(malformed)?;
        let count = count
            .trim()
            .parse::<NonZeroU32>()
            .map_err(|_| malformed())?;
        let quota = match period.trim() {
            "s" => Quota::per_second(count),
            "m" => Quota::per_minute(count),
            "h" => Quota::per_hour(count),
            _ => return Err(malformed()),
        };
        Ok(Self(quota))
    }
}

/// Who may call the API: nobody needs a key when none is configured.
pub struct Access {
    keys: Vec<ApiKey>,
    /// One limiter per key, same order; empty when rate limits are off.
    limiters: Vec<DefaultDirectRateLimiter>,
    /// `/metrics` needs a key (of any role) too.
    protect_metrics: bool,
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Access")
            .field("keys", &self.keys.len())
            .field("rate_limited", &!self.limiters.is_empty())
            .finish()
    }
}

impl Access {
    /// No keys: every request acts for the default tenant.
    pub fn open() -> Self {
        Self {
            keys: Vec::new(),
            limiters: Vec::new(),
            protect_metrics: false,
        }
    }

    /// Keys from `entries`, each `tenant:role:key`; `name(i)` says where
    /// entry `i` came from in an error, which never repeats the entry.
    /// Returns the access and warnings to log.
    pub fn from_entries<'a>(
        entries: impl Iterator<Item = &'a str>,
        name: impl Fn(usize) -> String,
        rate: Option<Rate>,
    ) -> Result<(Self, Vec<String>), String> {
        let mut keys: Vec<ApiKey> = Vec::new();
        let mut warnings = Vec::new();
        for (i, entry) in entries.enumerate() {
            let malformed = |why: &str| {
                format!(
                    "{} is malformed: {why}; expected tenant:role:key with role `user` or `admin`",
                    name(i)
                )
            };
            let mut parts = entry.trim().splitn(3, ':');
            let (Some(tenant), Some(role), Some(secret)) =
                (parts.next(), parts.next(), parts.next())
            else {
                return Err(malformed("it does not have three parts"));
            };
            if tenant.is_empty()
                || tenant.len() > TENANT_MAX_BYTES
                || !tenant.bytes().all(|b| b.is_ascii_graphic() && b != b',')
            {
                return Err(malformed(
                    "the tenant must be 1-64 visible ASCII characters other than `,` and `:`",
                ));
            }
            let role = match role {
                "user" => Role::User,
                "admin" => Role::Admin,
                _ => return Err(malformed("the role is neither `user` nor `admin`")),
            };
            if secret.is_empty() || !secret.bytes().all(|b| b.is_ascii_graphic() && b != b',') {
                return Err(malformed(
                    "the key must be visible ASCII characters other than `,`",
                ));
            }
            if secret.len() < SHORT_KEY {
                warnings.push(format!(
                    "{} has a key shorter than {SHORT_KEY} characters; use long random keys",
                    name(i)
                ));
            }
            let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
            if keys.iter().any(|k| k.digest == digest) {
                return Err(format!("{} repeats a key given before it", name(i)));
            }
            keys.push(ApiKey {
                tenant: Tenant::new(tenant),
                role,
                digest,
            });
        }
        let limiters = match rate {
            Some(Rate(quota)) => keys.iter().map(|_| RateLimiter::direct(quota)).collect(),
            None => Vec::new(),
        };
        Ok((
            Self {
                keys,
                limiters,
                protect_metrics: false,
            },
            warnings,
        ))
    }

    pub fn is_open(&self) -> bool {
        self.keys.is_empty()
    }

    /// Makes `/metrics` need a key; refused when there are no keys.
    pub fn protecting_metrics(mut self) -> Result<Self, String> {
        if self.is_open() {
            return Err(
                "CHAT_HISTORY_METRICS_REQUIRE_KEY needs API keys (CHAT_HISTORY_API_KEYS)".into(),
            );
        }
        self.protect_metrics = true;
        Ok(self)
    }

    /// The index of the key `presented` is, comparing it with every key in
    /// constant time (digests of equal length, no early exit).
    fn authenticate(&self, presented: &str) -> Option<usize> {
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let mut found = None;
        for (i, key) in self.keys.iter().enumerate() {
            if bool::from(key.digest.ct_eq(&digest)) {
                found = Some(i);
            }
        }
        found
    }
}

/// The tenant of the key a request was authenticated with, put in the
/// request by [`authorize`]; only the `Tenant` extractor reads it.
#[derive(Debug, Clone)]
pub struct Verified(pub Tenant);

/// The token of an `Authorization: Bearer <token>` header.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Guards `/v1`: with keys configured, a request needs a known bearer key
/// (401), an admin key for `/v1/admin` (403), and room in its key's rate
/// limit (429); it then acts for the key's tenant. `/metrics` needs a key
/// when so configured; other paths stay open. The `Err` is the answer to a
/// request refused (boxed: it is rare, and a `Response` is large).
pub fn authorize(access: &Access, request: &mut Request) -> Result<(), Box<Response>> {
    let path = request.uri().path();
    if access.protect_metrics && path == "/metrics" {
        return match bearer(request.headers()).and_then(|token| access.authenticate(token)) {
            Some(_) => Ok(()),
            None => Err(Box::new(unauthorized())),
        };
    }
    if access.is_open() || !(path == "/v1" || path.starts_with("/v1/")) {
        return Ok(());
    }
    let is_admin_path = path.starts_with("/v1/admin/") || path == "/v1/admin";
    let Some(index) = bearer(request.headers()).and_then(|token| access.authenticate(token)) else {
        return Err(Box::new(unauthorized()));
    };
    let key = &access.keys[index];
    if is_admin_path && key.role != Role::Admin {
        return Err(Box::new(
            Problem::new(
                StatusCode::FORBIDDEN,
                "this key's role is `user`; /v1/admin needs a key with role `admin`",
            )
            .into_response(),
        ));
    }
    if let Some(limiter) = access.limiters.get(index) {
        if let Err(not_until) = limiter.check() {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            let seconds = (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1);
            let mut response = Problem::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("this key is over its rate limit; retry in {seconds} s"),
            )
            .into_response();
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
            return Err(Box::new(response));
        }
    }
    request
        .extensions_mut()
        .insert(Verified(key.tenant.clone()));
    Ok(())
}

/// 401 with `WWW-Authenticate: Bearer`.
pub fn unauthorized() -> Response {
    let mut response = Problem::new(
        StatusCode::UNAUTHORIZED,
        "send a valid API key as `Authorization: Bearer <key>`",
    )
    .into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"chat-history\""),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(entries: &[&str]) -> Result<Access, String> {
        Access::from_entries(
            entries.iter().copied(),
            |i| format!("entry {}", i + 1),
            None,
        )
        .map(|(access, _)| access)
    }

    #[test]
    fn entries_parse_and_authenticate() {
        let access = access(&[
            "acme:user:key-one-0123456789",
            "acme:admin:key-two-0123456789",
        ])
        .unwrap();
        assert_eq!(access.authenticate("key-one-0123456789"), Some(0));
        assert_eq!(access.authenticate("key-two-0123456789"), Some(1));
        assert_eq!(access.authenticate("key-two-012345678"), None);
        assert_eq!(access.authenticate(""), None);
        assert_eq!(access.keys[1].role, Role::Admin);
        assert_eq!(access.keys[0].tenant.as_str(), "acme");
    }

    #[test]
    fn keys_may_contain_colons() {
        let access = access(&["t:user:a:b:c-0123456789abcdef"]).unwrap();
        assert_eq!(access.authenticate("a:b:c-0123456789abcdef"), Some(0));
    }

    #[test]
    fn malformed_entries_are_refused_without_echoing_the_key() {
        for bad in [
            "acme:owner:s3cr3t-value-123456",
            "acme:s3cr3t-value-123456",
            ":user:s3cr3t-value-123456",
            "acme:user:",
            "acme:user:s3cr3t value",
        ] {
            let error = access(&[bad]).unwrap_err();
            assert!(error.starts_with("entry 1 is malformed"), "{error}");
            assert!(!error.contains("s3cr3t"), "{error}");
        }
        let error =
            access(&["a:user:same-key-0123456789", "b:admin:same-key-0123456789"]).unwrap_err();
        assert!(error.contains("entry 2 repeats"), "{error}");
        assert!(!error.contains("same-key"), "{error}");
    }

    #[test]
    fn short_keys_are_warned_about_without_echoing_them() {
        let (_, warnings) =
            Access::from_entries(["a:user:short"].into_iter(), |_| "entry 1".into(), None).unwrap();
        assert_eq!(warnings.len(), 1);
        assert!(!warnings[0].contains("short:") && !warnings[0].contains(":short"));
    }

    #[test]
    fn debug_shows_no_key_material() {
        let access = access(&["acme:user:key-one-0123456789"]).unwrap();
        let shown = format!("{access:?}");
        assert!(
            !shown.contains("key-one") && !shown.contains("acme"),
            "{shown}"
        );
    }

    #[test]
    fn rates_read_like_100_per_second() {
        assert!("100/s".parse::<Rate>().is_ok());
        assert!("6000/m".parse::<Rate>().is_ok());
        assert!("5/h".parse::<Rate>().is_ok());
        for bad in ["0/s", "100", "100/d", "x/s"] {
            assert!(bad.parse::<Rate>().is_err(), "{bad}");
        }
    }

    #[test]
    fn bearer_tokens() {
        let mut headers = HeaderMap::new();
        assert_eq!(bearer(&headers), None);
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer abc"),
        );
        assert_eq!(bearer(&headers), Some("abc"));
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer  abc "),
        );
        assert_eq!(bearer(&headers), Some("abc"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(bearer(&headers), None);
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer "));
        assert_eq!(bearer(&headers), None);
    }
}
