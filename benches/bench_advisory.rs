//! `cargo run --release -p inbox-benches --bin bench_advisory`: what the metered API's
//! advisory layer (`inbox_examples::metered::redis`, on the `redis` crate's
//! `ConnectionManager`) costs a request, and how long it waits for a Redis that does
//! not answer.
//!
//! - `healthy`: `rate_limit` (an `INCR` + `EXPIRE` pipeline) against `REDIS_URL`
//!   (default `redis://127.0.0.1:6379`), one caller after another (median
//!   microseconds per call) and from `BENCH_CALLERS` concurrent tasks (default 50)
//!   on the one multiplexed connection (calls per second);
//! - `stalled`: a listener that accepts and never answers: milliseconds per call
//!   (each fails open after the 250 ms request budget);
//! - `closed`: a port nothing listens on: milliseconds per call.
//!
//! Each figure is the median of `BENCH_ROUNDS` rounds (default 3) of `BENCH_CALLS`
//! calls (default 2,000; 8 for the stalled server). Figures only: no timing is
//! asserted. Keys live under `bench:advisory:<pid>` and expire within 2 s.

use std::sync::Arc;
use std::time::Instant;

use inbox_benches::{env_or, median};
use inbox_examples::metered::redis::{Advisory, Redis};

fn advisory(url: &str) -> Arc<Advisory> {
    let redis = Redis::new(url).unwrap_or_else(|e| panic!("REDIS_URL: {e}"));
    Arc::new(Advisory::new(
        redis,
        format!("bench:advisory:{}", std::process::id()),
    ))
}

/// Microseconds per call, one call after another.
async fn sequential(advisory: &Advisory, calls: u64) -> f64 {
    let started = Instant::now();
    for i in 0..calls {
        advisory
            .rate_limit(i64::try_from(i % 100).unwrap_or(0), u64::MAX, 0)
            .await;
    }
    started.elapsed().as_secs_f64() * 1e6 / calls as f64
}

/// Calls per second from `callers` concurrent tasks.
async fn concurrent(advisory: &Arc<Advisory>, callers: u64, calls: u64) -> f64 {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..callers {
        let advisory = Arc::clone(advisory);
        let per_caller = calls / callers;
        tasks.spawn(async move {
            for _ in 0..per_caller {
                advisory
                    .rate_limit(i64::try_from(c).unwrap_or(0), u64::MAX, 0)
                    .await;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    (calls / callers * callers) as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let rounds: usize = env_or("BENCH_ROUNDS", 3);
    let calls: u64 = env_or("BENCH_CALLS", 2_000);
    let callers: u64 = env_or("BENCH_CALLERS", 50);

    let healthy = advisory(&url);
    sequential(&healthy, 100).await; // connect and warm up
    let mut one = Vec::new();
    let mut many = Vec::new();
    for _ in 0..rounds {
        one.push(sequential(&healthy, calls).await);
        many.push(concurrent(&healthy, callers, calls).await);
    }
    println!(
        "healthy: {:.0} us per call one at a time; {:.0} calls/s from {callers} tasks",
        median(one),
        median(many)
    );
    assert_eq!(healthy.stats.fallbacks(), 0, "healthy Redis fell back");

    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("listener: {e}"));
    let silent_addr = silent
        .local_addr()
        .unwrap_or_else(|e| panic!("listener: {e}"));
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            open.push(stream);
        }
    });
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        l.local_addr().unwrap_or_else(|e| panic!("{e}"))
    };
    for (name, addr, n) in [("stalled", silent_addr, 8), ("closed", closed, calls)] {
        let down = advisory(&format!("redis://{addr}"));
        let mut per_call = Vec::new();
        for _ in 0..rounds {
            per_call.push(sequential(&down, n).await / 1000.0);
        }
        println!(
            "{name}: {:.2} ms per call (fails open; {} fallbacks)",
            median(per_call),
            down.stats.fallbacks()
        );
    }
    held.abort();
}
