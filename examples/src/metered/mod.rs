//! `metered_api`: a metered HTTP API that charges before it works and refunds when
//! it fails, with idempotent replays, Redis as an advisory cache and settlements
//! that heal a crash between debit and refund. See the README's "Metered API".

pub mod app;
pub mod auth_limit;
pub mod config;
pub mod db;
pub mod http;
pub mod log;
pub mod meter;
pub mod redis;
pub mod serve;
pub mod settle;
pub mod speech;
pub mod stream;
pub mod upstream;
