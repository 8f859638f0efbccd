//! A minimal Redis client (RESP2 over one pipelined TCP connection) and the advisory
//! layer on top: rate limit, concurrency slots and the API-key cache. Every command
//! runs under a time budget; on the request path a timeout or an error falls back
//! silently (the limiter allows, the slot is granted, the cache misses) and counts
//! a fallback. Only the health probe may declare the connection dead: it closes the
//! connection it just showed does not answer, and the next command opens another.
//!
//! Why not the `redis` crate: the service sends six commands; a RESP encoder and
//! decoder is a page, while the crate with its tokio support brings a parser
//! combinator library, URL parsing with IDNA tables and more.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// The budget of one command on the request path.
pub const REQUEST_BUDGET: Duration = Duration::from_millis(250);

/// The budget of the health probe.
pub const PROBE_BUDGET: Duration = Duration::from_secs(2);

/// Commands waiting for a reply on one connection beyond which new ones fail at
/// once (a stalled server would otherwise collect them without end).
const MAX_PENDING: usize = 10_000;

/// A reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    /// `+OK`.
    Status(String),
    /// `-ERR ...`.
    Error(String),
    /// `:42`.
    Int(i64),
    /// `$5 hello`, or `$-1` (none).
    Bulk(Option<Vec<u8>>),
    /// `*2 ...`, or `*-1`.
    Array(Option<Vec<Value>>),
}

/// Why a command got no reply.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// The budget ran out.
    #[error("redis command timed out")]
    Timeout,
    /// The connection failed or is gone.
    #[error("redis connection failed: {0}")]
    Io(String),
    /// The server answered with an error or something unexpected.
    #[error("redis replied {0}")]
    Reply(String),
    /// The URL is not `redis://[:password@]host[:port][/db]`.
    #[error("invalid REDIS_URL: {0}")]
    Url(String),
}

/// Encodes a command as a RESP array of bulk strings.
pub fn encode(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
    out
}

async fn read_line(r: &mut BufReader<OwnedReadHalf>) -> Result<String, RedisError> {
    let mut line = String::new();
    let n = r
        .read_line(&mut line)
        .await
        .map_err(|e| RedisError::Io(e.to_string()))?;
    if n == 0 {
        return Err(RedisError::Io("connection closed".into()));
    }
    Ok(line.trim_end_matches(['\r', '\n']).to_owned())
}

/// Reads one reply.
fn read_value(
    r: &mut BufReader<OwnedReadHalf>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Value, RedisError>> + Send + '_>> {
    Box::pin(async move {
        let line = read_line(r).await?;
        let (kind, rest) = line.split_at(line.len().min(1));
        let int = |s: &str| {
            s.parse::<i64>()
                .map_err(|_| RedisError::Reply(format!("bad length or integer {s:?}")))
        };
        match kind {
            "+" => Ok(Value::Status(rest.to_owned())),
            "-" => Ok(Value::Error(rest.to_owned())),
            ":" => Ok(Value::Int(int(rest)?)),
            "$" => {
                let len = int(rest)?;
                if len < 0 {
                    return Ok(Value::Bulk(None));
                }
                let len = usize::try_from(len).map_err(|_| RedisError::Reply(line.clone()))?;
                let mut buf = vec![0; len + 2];
                r.read_exact(&mut buf)
                    .await
                    .map_err(|e| RedisError::Io(e.to_string()))?;
                buf.truncate(len);
                Ok(Value::Bulk(Some(buf)))
            }
            "*" => {
                let len = int(rest)?;
                if len < 0 {
                    return Ok(Value::Array(None));
                }
                let mut items = Vec::new();
                for _ in 0..len {
                    items.push(read_value(r).await?);
                }
                Ok(Value::Array(Some(items)))
            }
            _ => Err(RedisError::Reply(format!("unknown reply {line:?}"))),
        }
    })
}

type Reply = oneshot::Sender<Result<Vec<Value>, RedisError>>;

/// A command batch waiting for its replies.
struct Pending {
    replies: usize,
    tx: Reply,
}

/// One pipelined connection: a writer task sends in order, a reader task matches
/// replies to commands in the same order. A command whose caller stopped waiting
/// still gets its reply matched (and dropped), so replies never shift.
struct Conn {
    tx: mpsc::UnboundedSender<(Vec<u8>, Pending)>,
    dead: Arc<AtomicBool>,
    waiting: Arc<AtomicU64>,
    /// Closes the socket when the connection is declared dead.
    close: tokio::sync::watch::Sender<bool>,
}

impl Conn {
    async fn open(target: &Target) -> Result<Conn, RedisError> {
        let stream = TcpStream::connect(&target.addr)
            .await
            .map_err(|e| RedisError::Io(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        let (read, mut write) = stream.into_split();
        let (tx, mut rx) = mpsc::unbounded_channel::<(Vec<u8>, Pending)>();
        let queue: Arc<Mutex<VecDeque<Pending>>> = Arc::default();
        let dead = Arc::new(AtomicBool::new(false));
        let waiting = Arc::new(AtomicU64::new(0));
        let (close_tx, mut close_rx) = tokio::sync::watch::channel(false);
        let mut reader_close = close_tx.subscribe();

        let fail_all = {
            let queue = Arc::clone(&queue);
            let dead = Arc::clone(&dead);
            move |why: &str| {
                dead.store(true, Ordering::SeqCst);
                let mut q = queue.lock().unwrap_or_else(PoisonError::into_inner);
                for p in q.drain(..) {
                    let _ = p.tx.send(Err(RedisError::Io(why.to_owned())));
                }
            }
        };
        let writer_queue = Arc::clone(&queue);
        let writer_fail = fail_all.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    next = rx.recv() => {
                        let Some((bytes, pending)) = next else { break };
                        // Queued before it is written: its reply can only come after.
                        writer_queue
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push_back(pending);
                        if let Err(e) = write.write_all(&bytes).await {
                            writer_fail(&e.to_string());
                            break;
                        }
                    }
                    _ = close_rx.changed() => break,
                }
            }
            // Dropping the write half (and the reader below) closes the socket.
            writer_fail("connection closed");
        });
        let reader_queue = Arc::clone(&queue);
        let reader_waiting = Arc::clone(&waiting);
        tokio::spawn(async move {
            let mut reader = BufReader::new(read);
            let mut collected: Vec<Value> = Vec::new();
            loop {
                let read = tokio::select! {
                    read = read_value(&mut reader) => read,
                    _ = reader_close.changed() => break,
                };
                let value = match read {
                    Ok(v) => v,
                    Err(e) => {
                        fail_all(&e.to_string());
                        break;
                    }
                };
                collected.push(value);
                let mut q = reader_queue.lock().unwrap_or_else(PoisonError::into_inner);
                let Some(front) = q.front() else {
                    drop(q);
                    fail_all("reply without a command");
                    break;
                };
                if collected.len() >= front.replies {
                    if let Some(done) = q.pop_front() {
                        reader_waiting.fetch_sub(1, Ordering::SeqCst);
                        let _ = done.tx.send(Ok(std::mem::take(&mut collected)));
                    }
                }
            }
        });
        let conn = Conn {
            tx,
            dead,
            waiting,
            close: close_tx,
        };
        if let Some(password) = &target.password {
            conn.send(&[encode(&[b"AUTH", password.as_bytes()])])
                .await?;
        }
        if let Some(db) = &target.db {
            conn.send(&[encode(&[b"SELECT", db.as_bytes()])]).await?;
        }
        Ok(conn)
    }

    /// Sends a pipeline of commands; resolves with their replies (the caller bounds
    /// the wait).
    async fn send(&self, commands: &[Vec<u8>]) -> Result<Vec<Value>, RedisError> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(RedisError::Io("connection is dead".into()));
        }
        if self.waiting.load(Ordering::SeqCst) as usize >= MAX_PENDING {
            return Err(RedisError::Io("too many commands waiting".into()));
        }
        let (tx, rx) = oneshot::channel();
        let bytes = commands.concat();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.tx
            .send((
                bytes,
                Pending {
                    replies: commands.len(),
                    tx,
                },
            ))
            .map_err(|_| RedisError::Io("connection is gone".into()))?;
        let replies = rx
            .await
            .map_err(|_| RedisError::Io("connection is gone".into()))??;
        for r in &replies {
            if let Value::Error(e) = r {
                return Err(RedisError::Reply(e.clone()));
            }
        }
        Ok(replies)
    }

    fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
        let _ = self.close.send(true);
    }
}

#[derive(Clone)]
struct Target {
    addr: String,
    password: Option<String>,
    db: Option<String>,
}

/// The password never shows.
impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("addr", &self.addr)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("db", &self.db)
            .finish()
    }
}

fn parse_url(url: &str) -> Result<Target, RedisError> {
    let rest = url
        .strip_prefix("redis://")
        .ok_or_else(|| RedisError::Url("expected redis://host:port".into()))?;
    let (auth_host, db) = match rest.split_once('/') {
        Some((h, d)) if !d.is_empty() => (h, Some(d.to_owned())),
        Some((h, _)) => (h, None),
        None => (rest, None),
    };
    let (password, host) = match auth_host.rsplit_once('@') {
        Some((auth, host)) => {
            let password = auth.rsplit(':').next().unwrap_or(auth);
            ((!password.is_empty()).then(|| password.to_owned()), host)
        }
        None => (None, auth_host),
    };
    if host.is_empty() {
        return Err(RedisError::Url("no host".into()));
    }
    let addr = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:6379")
    };
    Ok(Target { addr, password, db })
}

/// The client: one connection at a time, opened on first use and again after the
/// probe declared it dead (or it broke).
pub struct Redis {
    target: Target,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
}

impl Redis {
    /// A client for `url`; nothing is connected yet.
    pub fn new(url: &str) -> Result<Self, RedisError> {
        Ok(Self {
            target: parse_url(url)?,
            conn: tokio::sync::Mutex::new(None),
        })
    }

    async fn connection(&self) -> Result<Arc<Conn>, RedisError> {
        let mut slot = self.conn.lock().await;
        if let Some(conn) = slot.as_ref() {
            if !conn.dead.load(Ordering::SeqCst) {
                return Ok(Arc::clone(conn));
            }
        }
        let conn = Arc::new(Conn::open(&self.target).await?);
        *slot = Some(Arc::clone(&conn));
        Ok(conn)
    }

    /// Runs a pipeline within `budget` (connecting included).
    pub async fn run(
        &self,
        budget: Duration,
        commands: &[Vec<u8>],
    ) -> Result<Vec<Value>, RedisError> {
        tokio::time::timeout(budget, async {
            let conn = self.connection().await?;
            conn.send(commands).await
        })
        .await
        .map_err(|_| RedisError::Timeout)?
    }

    /// The health probe: `PING` within 2 s. On failure the connection is declared
    /// dead and closed; the next command opens a new one.
    pub async fn probe(&self) -> bool {
        let conn = match tokio::time::timeout(PROBE_BUDGET, self.connection()).await {
            Ok(Ok(conn)) => conn,
            _ => return false,
        };
        let ok = matches!(
            tokio::time::timeout(PROBE_BUDGET, conn.send(&[encode(&[b"PING"])])).await,
            Ok(Ok(ref r)) if r.first() == Some(&Value::Status("PONG".into()))
        );
        if !ok {
            conn.kill();
            let mut slot = self.conn.lock().await;
            if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                *slot = None;
            }
        }
        ok
    }
}

/// Fallbacks and hits of the advisory layer, for `GET /admin/stats`.
#[derive(Debug, Default)]
pub struct AdvisoryStats {
    /// Rate-limit checks that failed open.
    pub rate_limit_fallbacks: AtomicU64,
    /// Concurrency slots granted because Redis did not answer.
    pub slot_fallbacks: AtomicU64,
    /// Key-cache look-ups that went to PostgreSQL because Redis did not answer.
    pub key_cache_fallbacks: AtomicU64,
    /// Key-cache hits.
    pub key_cache_hits: AtomicU64,
    /// Key-cache misses (Redis answered, the key was not cached).
    pub key_cache_misses: AtomicU64,
}

impl AdvisoryStats {
    /// Every fallback so far.
    pub fn fallbacks(&self) -> u64 {
        self.rate_limit_fallbacks.load(Ordering::Relaxed)
            + self.slot_fallbacks.load(Ordering::Relaxed)
            + self.key_cache_fallbacks.load(Ordering::Relaxed)
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
    /// Counters.
    pub stats: AdvisoryStats,
}

fn int_of(v: Option<&Value>) -> Option<i64> {
    match v {
        Some(Value::Int(n)) => Some(*n),
        _ => None,
    }
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
        let replies = self
            .redis
            .run(
                REQUEST_BUDGET,
                &[
                    encode(&[b"INCR", key.as_bytes()]),
                    encode(&[b"EXPIRE", key.as_bytes(), b"2"]),
                ],
            )
            .await;
        match replies.ok().and_then(|r| int_of(r.first())) {
            Some(n) if n > i64::try_from(limit).unwrap_or(i64::MAX) => Verdict::Refused,
            Some(_) => Verdict::Allowed,
            None => {
                self.stats
                    .rate_limit_fallbacks
                    .fetch_add(1, Ordering::Relaxed);
                Verdict::Allowed
            }
        }
    }

    /// Takes one of the account's `max` concurrency slots for `ttl` (a crashed
    /// process's slots expire); returns whether a slot must be given back.
    pub async fn take_slot(&self, account: i64, max: u64, ttl: Duration) -> (Verdict, bool) {
        let key = format!("{}:slots:{account}", self.prefix);
        let ttl_ms = ttl.as_millis().max(1).to_string();
        let replies = self
            .redis
            .run(
                REQUEST_BUDGET,
                &[
                    encode(&[b"INCR", key.as_bytes()]),
                    encode(&[b"PEXPIRE", key.as_bytes(), ttl_ms.as_bytes()]),
                ],
            )
            .await;
        match replies.ok().and_then(|r| int_of(r.first())) {
            Some(n) if n > i64::try_from(max).unwrap_or(i64::MAX) => {
                self.release_slot(account).await;
                (Verdict::Refused, false)
            }
            Some(_) => (Verdict::Allowed, true),
            None => {
                self.stats.slot_fallbacks.fetch_add(1, Ordering::Relaxed);
                (Verdict::Allowed, false)
            }
        }
    }

    /// Gives a slot back (best effort: the slot's expiry covers a failure).
    pub async fn release_slot(&self, account: i64) {
        let key = format!("{}:slots:{account}", self.prefix);
        let _ = self
            .redis
            .run(REQUEST_BUDGET, &[encode(&[b"DECR", key.as_bytes()])])
            .await;
    }

    /// A cached API key (`account_id:key_id`) by its digest.
    pub async fn cached_key(&self, digest_hex: &str) -> CacheLookup {
        let key = format!("{}:key:{digest_hex}", self.prefix);
        match self
            .redis
            .run(REQUEST_BUDGET, &[encode(&[b"GET", key.as_bytes()])])
            .await
        {
            Ok(replies) => {
                let parsed = match replies.first() {
                    Some(Value::Bulk(Some(v))) => std::str::from_utf8(v).ok().and_then(|s| {
                        let (a, k) = s.split_once(':')?;
                        Some((a.parse().ok()?, k.parse().ok()?))
                    }),
                    _ => None,
                };
                match parsed {
                    Some((account, key_id)) => {
                        self.stats.key_cache_hits.fetch_add(1, Ordering::Relaxed);
                        CacheLookup::Hit { account, key_id }
                    }
                    None => {
                        self.stats.key_cache_misses.fetch_add(1, Ordering::Relaxed);
                        CacheLookup::Miss
                    }
                }
            }
            Err(_) => {
                self.stats
                    .key_cache_fallbacks
                    .fetch_add(1, Ordering::Relaxed);
                CacheLookup::Unavailable
            }
        }
    }

    /// Caches a key for a minute (best effort).
    pub async fn cache_key(&self, digest_hex: &str, account: i64, key_id: i64) {
        let key = format!("{}:key:{digest_hex}", self.prefix);
        let value = format!("{account}:{key_id}");
        let _ = self
            .redis
            .run(
                REQUEST_BUDGET,
                &[encode(&[
                    b"SET",
                    key.as_bytes(),
                    value.as_bytes(),
                    b"EX",
                    b"60",
                ])],
            )
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_resp_arrays_of_bulk_strings() {
        assert_eq!(
            encode(&[b"SET", b"k", b"v"]),
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n".to_vec()
        );
    }

    #[test]
    fn urls() {
        let t = parse_url("redis://127.0.0.1:6380/2").unwrap();
        assert_eq!(
            (t.addr.as_str(), t.db.as_deref()),
            ("127.0.0.1:6380", Some("2"))
        );
        let t = parse_url("redis://:pw@localhost").unwrap();
        assert_eq!(
            (t.addr.as_str(), t.password.as_deref()),
            ("localhost:6379", Some("pw"))
        );
        assert!(parse_url("http://x").is_err());
    }
}
