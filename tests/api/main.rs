//! The one integration-test binary: every behaviour runs against a real
//! Postgres database and a real SQLite file.

mod access;
mod clock;
mod concurrency;
mod group_commit;
mod hostile;
mod http;
mod lifecycle;
mod operations;
mod plans;
mod replicas;
mod shutdown;
mod startup;
mod store_suite;
mod support;
mod transcripts;
mod transfer;
