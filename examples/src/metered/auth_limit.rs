//! A bound on failed authentications per client address, kept in the process: an
//! unknown API key costs a Redis and a PostgreSQL look-up, so a client sending them
//! is refused (429 `auth_rate_limited`) before it costs either.
//!
//! Each address has a bucket of `limit` tokens, refilled at `limit` per minute. An
//! authentication looks anything up only while its address has a token left, and a
//! key that is not found spends one; found keys spend nothing. Look-ups already in
//! flight when the bucket empties still finish (at most the listener's connection
//! cap of them). Memory is bounded: past [`MAX_ADDRESSES`] buckets, the
//! full ones (equal to a fresh bucket) are dropped; if none is, the addresses not
//! tracked share one bucket. Behind a proxy every client has the proxy's address.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// Addresses tracked at most.
pub const MAX_ADDRESSES: usize = 100_000;

/// The bucket of the addresses not tracked (no client has this address).
const SHARED: IpAddr = IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED);

#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The buckets of every client address.
#[derive(Debug)]
pub struct AuthFailures {
    limit: f64,
    buckets: Mutex<HashMap<IpAddr, Bucket>>,
}

impl AuthFailures {
    /// `limit` failures in a burst, `limit` more per minute.
    pub fn new(limit: u64) -> Self {
        Self {
            limit: limit as f64,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    fn refilled(&self, bucket: Bucket, now: Instant) -> Bucket {
        let per_second = self.limit / 60.0;
        let gained = now.saturating_duration_since(bucket.at).as_secs_f64() * per_second;
        Bucket {
            tokens: (bucket.tokens + gained).min(self.limit),
            at: now,
        }
    }

    /// Whether `addr` may look a key up (its bucket holds a token).
    pub fn allows(&self, addr: IpAddr) -> bool {
        let now = Instant::now();
        let buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        let bucket = match buckets.get(&addr) {
            Some(bucket) => bucket,
            None if buckets.len() < MAX_ADDRESSES => return true,
            None => match buckets.get(&SHARED) {
                Some(bucket) => bucket,
                None => return true,
            },
        };
        self.refilled(*bucket, now).tokens >= 1.0
    }

    /// Spends a token of `addr`'s bucket: a key it sent was not found.
    pub fn failed(&self, addr: IpAddr) {
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        let mut addr = addr;
        if !buckets.contains_key(&addr) && buckets.len() >= MAX_ADDRESSES {
            let limit = self.limit;
            buckets.retain(|a, b| *a == SHARED || self.refilled(*b, now).tokens < limit);
            if buckets.len() >= MAX_ADDRESSES {
                addr = SHARED;
            }
        }
        let bucket = buckets.entry(addr).or_insert(Bucket {
            tokens: self.limit,
            at: now,
        });
        let mut refilled = self.refilled(*bucket, now);
        refilled.tokens = (refilled.tokens - 1.0).max(0.0);
        *bucket = refilled;
    }

    /// How long until `addr` has a token again (for `Retry-After`).
    pub fn retry_after(&self) -> Duration {
        Duration::from_secs_f64((60.0 / self.limit).max(1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_spend_the_bucket_of_their_address() {
        let limits = AuthFailures::new(2);
        let a: IpAddr = [10, 0, 0, 1].into();
        let b: IpAddr = [10, 0, 0, 2].into();
        assert!(limits.allows(a));
        limits.failed(a);
        assert!(limits.allows(a));
        limits.failed(a);
        assert!(!limits.allows(a), "two failures spent the bucket");
        assert!(limits.allows(b), "another address has its own");
    }
}
