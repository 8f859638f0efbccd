//! The metered API's own counts, recorded through the `metrics` facade (exported at
//! `GET /metrics` on the admin listener as `metered_api_*`, described by
//! [`describe`]) and read back in process for `GET /admin/stats`.

use std::sync::atomic::{AtomicU64, Ordering};

/// Streams that ended with their final line, delivered.
pub const STREAMS_DELIVERED_TOTAL: &str = "metered_api_streams_delivered_total";
/// Streams cut and refunded.
pub const STREAMS_REFUNDED_TOTAL: &str = "metered_api_streams_refunded_total";
/// Refunds that failed on the request path.
pub const REFUND_FAILURES_TOTAL: &str = "metered_api_refund_failures_total";
/// Replays served from a saved response.
pub const REPLAYS_TOTAL: &str = "metered_api_replays_total";
/// Authentications refused because the client's address failed too often.
pub const AUTH_RATE_LIMITED_TOTAL: &str = "metered_api_auth_rate_limited_total";
/// Admin requests refused for a missing or wrong admin token.
pub const ADMIN_UNAUTHORIZED_TOTAL: &str = "metered_api_admin_unauthorized_total";
/// Settlement messages handled, by outcome (`refunded`, `already_settled`).
pub const SETTLEMENTS_TOTAL: &str = "metered_api_settlements_total";
/// Connections accepted, by listener (`public`, `admin`).
pub const CONNECTIONS_ACCEPTED_TOTAL: &str = "metered_api_connections_accepted_total";
/// Redis advisory commands that failed open on the request path, by kind
/// (`rate_limit`, `slot`, `key_cache`).
pub const REDIS_FALLBACKS_TOTAL: &str = "metered_api_redis_fallbacks_total";
/// API-key cache look-ups Redis answered, by outcome (`hit`, `miss`).
pub const KEY_CACHE_LOOKUPS_TOTAL: &str = "metered_api_key_cache_lookups_total";
/// Connections open now, by listener.
pub const CONNECTIONS_OPEN: &str = "metered_api_connections_open";

/// Describes the metered API's metrics to the installed recorder (units and help).
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, Unit};
    for (name, help) in [
        (
            STREAMS_DELIVERED_TOTAL,
            "Streams that ended with their final line, delivered.",
        ),
        (
            STREAMS_REFUNDED_TOTAL,
            "Streams cut (upstream failure, deadline, client gone) and refunded.",
        ),
        (
            REFUND_FAILURES_TOTAL,
            "Refunds that failed on the request path (the settlement refunds them later).",
        ),
        (REPLAYS_TOTAL, "Replays served from a saved response."),
        (
            AUTH_RATE_LIMITED_TOTAL,
            "Authentications refused because the client's address failed too often.",
        ),
        (
            ADMIN_UNAUTHORIZED_TOTAL,
            "Admin requests refused for a missing or wrong admin token.",
        ),
        (
            SETTLEMENTS_TOTAL,
            "Settlement messages handled, by outcome (refunded, already_settled).",
        ),
        (
            CONNECTIONS_ACCEPTED_TOTAL,
            "Connections accepted, by listener (public, admin).",
        ),
        (
            REDIS_FALLBACKS_TOTAL,
            "Redis advisory commands that failed open (timeout or error), by kind (rate_limit, slot, key_cache).",
        ),
        (
            KEY_CACHE_LOOKUPS_TOTAL,
            "API-key cache look-ups Redis answered, by outcome (hit, miss).",
        ),
    ] {
        describe_counter!(name, Unit::Count, help);
    }
    describe_gauge!(
        CONNECTIONS_OPEN,
        Unit::Count,
        "Connections open now, by listener (public, admin)."
    );
}

/// A count recorded through the facade (a counter of a name and fixed labels) and
/// kept in process for `GET /admin/stats`.
#[derive(Debug)]
pub struct Count {
    counter: metrics::Counter,
    value: AtomicU64,
}

impl Count {
    /// The count of the counter `name` with `labels`.
    pub fn new(name: &'static str, labels: &[(&'static str, &'static str)]) -> Self {
        let labels: Vec<metrics::Label> = labels
            .iter()
            .map(|(k, v)| metrics::Label::new(*k, *v))
            .collect();
        Self {
            counter: metrics::counter!(name, labels),
            value: AtomicU64::new(0),
        }
    }

    /// Adds `n`; returns the count after it.
    pub fn add(&self, n: u64) -> u64 {
        self.counter.increment(n);
        self.value.fetch_add(n, Ordering::Relaxed) + n
    }

    /// The count so far (for `GET /admin/stats`).
    pub fn get(&self) -> u64 {
        self.value.load(Ordering::Relaxed)
    }
}
