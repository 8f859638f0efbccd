#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod backend;
mod batch;
mod error;
mod ops;
mod pg;
mod schema;
mod sqlite;
mod store;
mod url;
mod verify;

pub use backend::StoreConnection;
pub use error::{Error, Result};
pub use store::{ClaimRecord, ClaimStatus, DeadLetter, Store, StoreBuilder};
pub use url::{redact, Backend};
