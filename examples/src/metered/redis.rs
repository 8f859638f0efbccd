//! The advisory layer over Redis: rate limit, concurrency slots and the API-key cache.
//! Every command runs under a time budget; on the request path a timeout or an error
//! falls back silently (the limiter allows, the slot is granted, the cache misses) and
//! counts a fallback.
//!
//! The client is the `redis` crate's [`ConnectionManager`]: one multiplexed connection,
//! reopened by the manager when it breaks (a dropped connection, a refused or timed-out
//! connection attempt), with no retry loop of its own: the next command after a failed
//! attempt starts the next attempt, and concurrent commands share it. The budgets:
//!
//! - a reply: [`REQUEST_BUDGET`] (250 ms, the manager's response timeout), and a
//!   command on the request path waits no longer than that in all, a connection being
//!   opened by an earlier command included;
//! - opening a connection (TCP, then the handshake: `AUTH` with the URL's user name
//!   and password, `SELECT`): [`PROBE_BUDGET`] (2 s, the manager's connection timeout;
//!   a request stops waiting for it after its own 250 ms, the attempt goes on for the
//!   next ones);
//! - the health probe: `PING` within [`PROBE_BUDGET`], a connection being opened
//!   included.
//!
//! A connection whose replies stop coming (response timeouts, no broken socket) is
//! not one the manager reopens, so the probe is the one place that declares a live
//! connection dead: when its `PING` fails, the manager is dropped (its connection
//! closes once the commands in flight on it give up) and the next command opens a
//! new one.
//!
//! `REDIS_URL` is `redis://[[user]:password@]host[:port][/db]`, parsed by the crate:
//! the ACL user name is sent with the password (`AUTH user password`), a password may
//! hold `:`, and both are percent-decoded (`%40` for `@`, `%2F` for `/`, `%25` for
//! `%`). `rediss://` is refused: this build has no TLS.
//!
//! What stays hand-written here is the advisory logic itself (which commands, what a
//! missing answer means), not a client.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::meter::{self, Count};

/// The budget of one command on the request path.
pub const REQUEST_BUDGET: Duration = Duration::from_millis(250);

/// The budget of the health probe, and of opening a connection.
pub const PROBE_BUDGET: Duration = Duration::from_secs(2);

/// Why a command got no reply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// The budget ran out.
    #[error("redis command timed out")]
    Timeout,
    /// The connection failed, or the server answered with an error or something
    /// unexpected.
    #[error("redis command failed")]
    Command(#[source] redis::RedisError),
    /// `REDIS_URL` is not `redis://[[user]:password@]host[:port][/db]`.
    #[error("invalid REDIS_URL")]
    Url(#[source] redis::RedisError),
}

/// The manager's settings: the budgets above, and no retry of its own (a request
/// cannot wait out a backoff in 250 ms; the next command tries again).
fn manager_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_response_timeout(Some(REQUEST_BUDGET))
        .set_connection_timeout(Some(PROBE_BUDGET))
        .set_number_of_retries(0)
}

/// The client: one connection manager at a time, connected on first use and replaced
/// after the probe found it does not answer.
pub struct Redis {
    client: redis::Client,
    manager: Mutex<ConnectionManager>,
}

impl std::fmt::Debug for Redis {
    /// The password never shows (the crate's own `Debug` redacts it).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redis")
            .field("connection", self.client.get_connection_info())
            .finish_non_exhaustive()
    }
}

impl Redis {
    /// A client for `url`; nothing is connected yet. Call it inside a tokio runtime.
    pub fn new(url: &str) -> Result<Self, RedisError> {
        let client = client(url)?;
        let manager = lazy_manager(&client)?;
        Ok(Self {
            client,
            manager: Mutex::new(manager),
        })
    }

    /// The current manager (a cheap handle on its one connection).
    fn manager(&self) -> ConnectionManager {
        self.manager
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Runs a pipeline within `budget` (waiting for a connection included).
    pub async fn run<T: redis::FromRedisValue>(
        &self,
        budget: Duration,
        pipeline: &redis::Pipeline,
    ) -> Result<T, RedisError> {
        let mut manager = self.manager();
        tokio::time::timeout(budget, pipeline.query_async(&mut manager))
            .await
            .map_err(|_| RedisError::Timeout)?
            .map_err(RedisError::Command)
    }

    /// The health probe: `PING` within 2 s. On failure the manager is dropped with
    /// its connection; the next command opens a new one.
    pub async fn probe(&self) -> bool {
        let mut manager = self.manager();
        let ping = redis::cmd("PING");
        let ping = ping.query_async::<String>(&mut manager);
        let ok = matches!(
            tokio::time::timeout(PROBE_BUDGET, ping).await,
            Ok(Ok(ref pong)) if pong == "PONG"
        );
        if !ok {
            if let Ok(fresh) = lazy_manager(&self.client) {
                *self.manager.lock().unwrap_or_else(PoisonError::into_inner) = fresh;
            }
        }
        ok
    }
}

/// The crate's client for `url` (parsing only; `redis://` alone).
fn client(url: &str) -> Result<redis::Client, RedisError> {
    redis::Client::open(url).map_err(RedisError::Url)
}

fn lazy_manager(client: &redis::Client) -> Result<ConnectionManager, RedisError> {
    ConnectionManager::new_lazy_with_config(client.clone(), manager_config())
        .map_err(RedisError::Command)
}

/// Fallbacks and hits of the advisory layer, for `GET /admin/stats` and
/// `GET /metrics` (`metered_api_redis_fallbacks_total{kind}`,
/// `metered_api_key_cache_lookups_total{outcome}`).
#[derive(Debug)]
pub struct AdvisoryStats {
    /// Rate-limit checks that failed open.
    pub rate_limit_fallbacks: Count,
    /// Concurrency slots granted because Redis did not answer.
    pub slot_fallbacks: Count,
    /// Key-cache look-ups that went to PostgreSQL because Redis did not answer.
    pub key_cache_fallbacks: Count,
    /// Key-cache hits.
    pub key_cache_hits: Count,
    /// Key-cache misses (Redis answered, the key was not cached).
    pub key_cache_misses: Count,
}

impl Default for AdvisoryStats {
    /// Registers the counters with the recorder installed now (install it first).
    fn default() -> Self {
        let fallbacks = |kind| Count::new(meter::REDIS_FALLBACKS_TOTAL, &[("kind", kind)]);
        let lookups = |outcome| Count::new(meter::KEY_CACHE_LOOKUPS_TOTAL, &[("outcome", outcome)]);
        Self {
            rate_limit_fallbacks: fallbacks("rate_limit"),
            slot_fallbacks: fallbacks("slot"),
            key_cache_fallbacks: fallbacks("key_cache"),
            key_cache_hits: lookups("hit"),
            key_cache_misses: lookups("miss"),
        }
    }
}

impl AdvisoryStats {
    /// Every fallback so far.
    pub fn fallbacks(&self) -> u64 {
        self.rate_limit_fallbacks.get() + self.slot_fallbacks.get() + self.key_cache_fallbacks.get()
    }
}

/// What the key cache said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheLookup {
    /// Cached: the key's account and id (the debit re-checks the key's state).
    Hit {
        /// The account.
        account: i64,
        /// The key's id.
        key_id: i64,
    },
    /// Redis answered: not cached.
    Miss,
    /// Redis did not answer in time: look in PostgreSQL, and do not try to cache.
    Unavailable,
}

/// What the rate limiter says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Go on (possibly because Redis did not answer).
    Allowed,
    /// Refuse (429 or 503).
    Refused,
}

/// The advisory layer: may be wrong, may vanish; never decides money.
pub struct Advisory {
    redis: Redis,
    prefix: String,
    /// Counters (registered with the recorder installed when the layer is made).
    pub stats: AdvisoryStats,
}

impl Advisory {
    /// The layer over `redis`, its keys under `prefix`.
    pub fn new(redis: Redis, prefix: impl Into<String>) -> Self {
        Self {
            redis,
            prefix: prefix.into(),
            stats: AdvisoryStats::default(),
        }
    }

    /// The client (for the health probe).
    pub fn redis(&self) -> &Redis {
        &self.redis
    }

    /// A fixed one-second window per API key: at most `limit` requests.
    pub async fn rate_limit(&self, key_id: i64, limit: u64, second: i64) -> Verdict {
        let key = format!("{}:rl:{key_id}:{second}", self.prefix);
        let mut pipe = redis::pipe();
        pipe.incr(&key, 1).expire(&key, 2).ignore();
        let count = self.redis.run::<(i64,)>(REQUEST_BUDGET, &pipe).await;
        match count.ok().map(|(n,)| n) {
            Some(n) if n > i64::try_from(limit).unwrap_or(i64::MAX) => Verdict::Refused,
            Some(_) => Verdict::Allowed,
            None => {
                self.stats.rate_limit_fallbacks.add(1);
                Verdict::Allowed
            }
        }
    }

    /// Takes one of the account's `max` concurrency slots for `ttl` (a crashed
    /// process's slots expire); returns whether a slot must be given back.
    pub async fn take_slot(&self, account: i64, max: u64, ttl: Duration) -> (Verdict, bool) {
        let key = format!("{}:slots:{account}", self.prefix);
        let ttl_ms = i64::try_from(ttl.as_millis().max(1)).unwrap_or(i64::MAX);
        let mut pipe = redis::pipe();
        pipe.incr(&key, 1).pexpire(&key, ttl_ms).ignore();
        let count = self.redis.run::<(i64,)>(REQUEST_BUDGET, &pipe).await;
        match count.ok().map(|(n,)| n) {
            Some(n) if n > i64::try_from(max).unwrap_or(i64::MAX) => {
                self.release_slot(account).await;
                (Verdict::Refused, false)
            }
            Some(_) => (Verdict::Allowed, true),
            None => {
                self.stats.slot_fallbacks.add(1);
                (Verdict::Allowed, false)
            }
        }
    }

    /// Gives a slot back (best effort: the slot's expiry covers a failure).
    pub async fn release_slot(&self, account: i64) {
        let key = format!("{}:slots:{account}", self.prefix);
        let mut pipe = redis::pipe();
        pipe.decr(&key, 1).ignore();
        let _ = self.redis.run::<()>(REQUEST_BUDGET, &pipe).await;
    }

    /// A cached API key (`account_id:key_id`) by its digest.
    pub async fn cached_key(&self, digest_hex: &str) -> CacheLookup {
        let key = format!("{}:key:{digest_hex}", self.prefix);
        let mut pipe = redis::pipe();
        pipe.get(&key);
        match self
            .redis
            .run::<(Option<Vec<u8>>,)>(REQUEST_BUDGET, &pipe)
            .await
        {
            Ok((cached,)) => {
                let parsed = cached.as_deref().and_then(|v| {
                    let (a, k) = std::str::from_utf8(v).ok()?.split_once(':')?;
                    Some((a.parse().ok()?, k.parse().ok()?))
                });
                match parsed {
                    Some((account, key_id)) => {
                        self.stats.key_cache_hits.add(1);
                        CacheLookup::Hit { account, key_id }
                    }
                    None => {
                        self.stats.key_cache_misses.add(1);
                        CacheLookup::Miss
                    }
                }
            }
            Err(_) => {
                self.stats.key_cache_fallbacks.add(1);
                CacheLookup::Unavailable
            }
        }
    }

    /// Caches a key for a minute (best effort).
    pub async fn cache_key(&self, digest_hex: &str, account: i64, key_id: i64) {
        let key = format!("{}:key:{digest_hex}", self.prefix);
        let value = format!("{account}:{key_id}");
        let mut pipe = redis::pipe();
        pipe.set_ex(&key, value, 60).ignore();
        let _ = self.redis.run::<()>(REQUEST_BUDGET, &pipe).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(url: &str) -> (String, Option<String>, Option<String>, i64) {
        let client = client(url).unwrap();
        let info = client.get_connection_info();
        let redis = info.redis_settings();
        (
            info.addr().to_string(),
            redis.username().map(str::to_owned),
            redis.password().map(str::to_owned),
            redis.db(),
        )
    }

    #[test]
    fn urls_keep_the_port_and_the_database() {
        assert_eq!(
            settings("redis://127.0.0.1:6380/2"),
            ("127.0.0.1:6380".into(), None, None, 2)
        );
        assert_eq!(
            settings("redis://:pw@localhost"),
            ("localhost:6379".into(), None, Some("pw".into()), 0)
        );
        assert!(client("http://x").is_err());
    }

    /// What the hand-written parser lost: the ACL user name, a password after its
    /// first `:`, and percent-encoded characters.
    #[test]
    fn urls_keep_the_user_name_and_the_whole_decoded_password() {
        assert_eq!(
            settings("redis://meter:a:b%3Ac%25d%40e%2Ff@cache.internal:6390/3"),
            (
                "cache.internal:6390".into(),
                Some("meter".into()),
                Some("a:b:c%d@e/f".into()),
                3
            )
        );
        assert_eq!(
            settings("redis://us%65r%3Ax:pw@h"),
            ("h:6379".into(), Some("user:x".into()), Some("pw".into()), 0)
        );
    }

    #[test]
    fn the_password_never_shows_in_debug() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _in_runtime = rt.enter();
        let redis = Redis::new("redis://meter:t0p-s3cret@127.0.0.1:1").unwrap();
        let shown = format!("{redis:?}");
        assert!(!shown.contains("t0p-s3cret"), "{shown}");
        assert!(shown.contains("meter"), "{shown}");
    }
}
