//! A process that used the store exits with its own exit code, never SIGSEGV.
//!
//! r2d2 refills its pool on background threads; a thread still inside libpq's TLS
//! setup when the process exits used to race OpenSSL's `atexit` cleanup and crash the
//! process after all its work was done (a test binary whose tests had all passed, an
//! example that failed its startup cleanly). The store initialises OpenSSL without
//! that cleanup (`inbox_diesel::init_tls`); this test re-runs itself as a child that
//! uses the store and exits at once, many times, under CPU load.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use diesel::PgConnection;
use inbox_diesel::Store;
use inbox_test_support::{Fixture, PgFixture};

const CHILD: &str = "INBOX_EXIT_TEST_CHILD";

/// Busy threads for the length of the test: the race shows under load.
struct Load(Arc<AtomicBool>, Vec<std::thread::JoinHandle<()>>);

impl Load {
    fn start(threads: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let handles = (0..threads)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                        std::hint::black_box(x);
                    }
                })
            })
            .collect();
        Self(stop, handles)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
        for h in self.1.drain(..) {
            let _ = h.join();
        }
    }
}

/// The child's body: build a store, take connections so the pool refills itself on
/// its own threads, and return at once (the harness then exits the process).
#[test]
fn child_uses_the_store_then_exits() {
    let Ok(schema) = std::env::var(CHILD) else {
        return; // only meaningful as the child of the test below
    };
    let url = std::env::var("INBOX_EXIT_TEST_URL").unwrap();
    let store = Store::<PgConnection>::builder(url)
        .schema(schema)
        .pool_size(8)
        .build()
        .unwrap();
    let held: Vec<_> = (0..3).map(|_| store.connection().unwrap()).collect();
    drop(held);
}

#[test]
fn a_test_binary_that_used_the_store_exits_cleanly_under_load() {
    let Some(fx) = PgFixture::new() else { return };
    // Migrate once here, so each child only connects.
    drop(fx.builder().build().unwrap());
    let exe = std::env::current_exe().unwrap();
    let _load = Load::start(2);
    let runs = 40;
    let mut bad = Vec::new();
    for run in 0..runs {
        let out = Command::new(&exe)
            .args([
                "--exact",
                "child_uses_the_store_then_exits",
                "--test-threads=1",
            ])
            .env(CHILD, &fx.schema)
            .env("INBOX_EXIT_TEST_URL", fx.url())
            .output()
            .unwrap();
        if !out.status.success() {
            bad.push((
                run,
                out.status,
                String::from_utf8_lossy(&out.stderr).into_owned(),
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {runs} child runs did not exit 0: {bad:?}",
        bad.len()
    );
}
