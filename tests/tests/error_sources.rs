//! Every error of the library crates prints its own message only and keeps its cause
//! as its `source`, so a reporter walking the chain (`inbox_core::ErrorChain`, or
//! any other) prints each cause once.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::error::Error as _;

use inbox_core::ErrorChain;
use inbox_test_support::{cause_printed_twice, everything_printed};

fn io(message: &str) -> Box<dyn std::error::Error + Send + Sync> {
    Box::new(std::io::Error::other(message.to_owned()))
}

/// Checks one error: it has a cause, the cause is printed once by the chain, and
/// nowhere twice.
fn once(err: &(dyn std::error::Error + 'static), cause: &str) {
    assert!(err.source().is_some(), "{err:?} keeps no cause");
    assert_eq!(cause_printed_twice(err), None, "{err:?}");
    let chain = ErrorChain(err).to_string();
    assert_eq!(chain.matches(cause).count(), 1, "{chain}");
    assert!(
        everything_printed(err)
            .iter()
            .any(|text| text.contains(cause)),
        "{err:?}"
    );
}

#[test]
fn core_errors_print_their_cause_once() {
    once(&inbox_core::Error::Store(io("disk full")), "disk full");
}

#[test]
fn store_errors_print_their_cause_once() {
    use inbox_diesel::Error;
    once(
        &Error::Database(diesel::result::Error::QueryBuilderError(
            "bad column".into(),
        )),
        "bad column",
    );
    once(&Error::Migration(io("no such table")), "no such table");
    once(
        &Error::Core(inbox_core::Error::Store(io("lost connection"))),
        "lost connection",
    );
    // A file that cannot be opened: the driver's own words are the cause.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir").join("inbox.db");
    let err = inbox_diesel::Store::<diesel::SqliteConnection>::builder(format!(
        "sqlite://{}",
        missing.display()
    ))
    .build()
    .expect_err("the directory does not exist");
    assert!(matches!(err, Error::Connect { .. }), "{err:?}");
    let cause = err.source().unwrap().to_string();
    once(&err, &cause);
    // Boxed into core's error, as transports see it.
    once(&inbox_core::Error::from(err), &cause);
}

#[test]
fn broker_errors_print_their_cause_once() {
    use inbox_amqp::Error;
    once(
        &Error::Store(inbox_core::Error::Store(io("store gone"))),
        "store gone",
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let join_error = runtime
        .block_on(async {
            tokio::task::spawn_blocking(|| std::panic::panic_any("worker exploded")).await
        })
        .unwrap_err();
    once(
        &Error::TaskFailed {
            task: "store",
            source: join_error,
        },
        "worker exploded",
    );
}
