//! The usage-billing projection the examples run: `usage.recorded` events folded into
//! `daily_usage(user_id, day, total)`, on PostgreSQL or SQLite with the same handler.

pub mod bench;
pub mod quickstart;
pub mod usage;
