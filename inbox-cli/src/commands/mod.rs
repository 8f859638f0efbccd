//! One module per command group, each with its own output; the arguments they
//! share are parsed here.

pub(crate) mod claims;
pub(crate) mod dead_letters;
pub(crate) mod groups;
pub(crate) mod purge;
pub(crate) mod reports;
pub(crate) mod selftest;
pub(crate) mod verify;
#[cfg(feature = "web")]
pub(crate) mod web;

use std::time::Duration;

use chrono::{DateTime, Utc};
use inbox_core::parse_duration;

use crate::exit;
use crate::failure::Failure;

/// RFC 3339, or a duration ago.
pub(crate) fn parse_time(text: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, Failure> {
    if let Ok(at) = DateTime::parse_from_rfc3339(text) {
        return Ok(at.with_timezone(&Utc));
    }
    let ago = parse_duration(text).map_err(|_| {
        Failure::new(
            exit::USAGE,
            format!("expected an RFC 3339 time or a duration ago (1h, 2d), found {text:?}"),
        )
    })?;
    chrono::TimeDelta::from_std(ago)
        .ok()
        .and_then(|d| now.checked_sub_signed(d))
        .ok_or_else(|| Failure::new(exit::USAGE, format!("{text:?} reaches before the calendar")))
}

pub(crate) fn duration_arg(text: &str, what: &str) -> Result<Duration, Failure> {
    parse_duration(text).map_err(|e| Failure::new(exit::USAGE, format!("--{what}: {e}")))
}
