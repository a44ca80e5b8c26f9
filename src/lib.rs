//! chat-history: a conversation-history service for bots and LLM agents.
//!
//! Read it top down: `domain` holds the product's nouns, `store` keeps them
//! in Postgres or SQLite behind one trait, `api` serves them over HTTP (behind
//! `auth`) with
//! `error` shaping every failure as problem+json, `cleanup` enforces retention,
//! `transfer` copies, exports and imports histories, and `server` runs it all.

pub mod api;
pub mod auth;
pub mod canonical;
pub mod cleanup;
pub mod config;
pub mod domain;
pub mod error;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod transfer;

pub use api::{openapi_json, router, AppState};
pub use config::Limits;
