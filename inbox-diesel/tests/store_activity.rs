//! The operator's activity counts on both backends, with a manual clock: exact counts
//! per bucket and in the last hour and day, lower bounds once a read stops at its
//! cap, and the query's validation.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, TimeZone, Utc};
use inbox_core::ManualClock;
use inbox_diesel::operator::{Activity, ActivityQuery, Count, Operator};
use inbox_diesel::{Error, Store};
use inbox_test_support::{
    group, on_both_backends, usage, Fixture, FullConnection, Outcome, Recorder,
};

const APPLIES: &str = "billing.daily-usage";
const REFUSES: &str = "billing.audit";

fn end() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 3, 2, 12, 0, 0).unwrap()
}

/// `APPLIES` processes a message at each of these many seconds before `end()` (0:
/// at `end()` itself, not counted yet; 86,401: over a day before).
const PROCESSED: [i64; 12] = [86_401, 3601, 3600, 301, 300, 299, 241, 240, 61, 60, 1, 0];
/// `REFUSES` dead-letters a message at each of these.
const DEAD: [i64; 3] = [7200, 90, 30];

fn scene<F: Fixture>(fx: &F) -> (Store<F::Conn>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(end() - TimeDelta::days(3)));
    let store = fx.open(
        fx.builder()
            .clock(clock.clone())
            .handler(Recorder::new(APPLIES))
            .handler(Recorder::new(REFUSES).behaviour(|_, _| Outcome::Permanent)),
    );
    let mut events: Vec<(i64, &str)> = PROCESSED
        .iter()
        .map(|s| (*s, APPLIES))
        .chain(DEAD.iter().map(|s| (*s, REFUSES)))
        .collect();
    events.sort_by_key(|(s, _)| -s);
    for (i, (secs, name)) in events.into_iter().enumerate() {
        clock.set(end() - TimeDelta::seconds(secs));
        store
            .process_batch(&group(name), &[usage(&format!("m-{i}"), 1)])
            .unwrap();
    }
    clock.set(end());
    (store, clock)
}

fn query(cap: u64) -> ActivityQuery {
    ActivityQuery::default()
        .interval(Duration::from_secs(60))
        .buckets(5)
        .cap(cap)
}

fn activity<C: FullConnection>(store: &Store<C>, cap: u64) -> Activity {
    Operator::new(store).activity(&query(cap)).unwrap()
}

/// (count, at_least) of each bucket, oldest first.
fn processed(a: &Activity, name: &str) -> Vec<(u64, bool)> {
    let g = a.groups.iter().find(|g| g.consumer_group == name).unwrap();
    g.buckets
        .iter()
        .map(|b| (b.processed.count, b.processed.at_least))
        .collect()
}

fn dead(a: &Activity, name: &str) -> Vec<(u64, bool)> {
    let g = a.groups.iter().find(|g| g.consumer_group == name).unwrap();
    g.buckets
        .iter()
        .map(|b| (b.dead_lettered.count, b.dead_lettered.at_least))
        .collect()
}

on_both_backends!(
    counts_per_bucket_hour_and_day_are_exact_under_the_cap,
    a_read_that_stops_at_its_cap_makes_older_counts_lower_bounds,
    a_query_out_of_range_is_refused_by_name,
);

fn counts_per_bucket_hour_and_day_are_exact_under_the_cap<F: Fixture>(fx: &F) {
    let (store, clock) = scene(fx);
    let a = activity(&store, 100_000);
    assert_eq!(a.at, end());
    assert_eq!(a.interval_secs, 60);
    let names: Vec<&str> = a.groups.iter().map(|g| g.consumer_group.as_str()).collect();
    assert_eq!(names, [REFUSES, APPLIES]);
    let starts: Vec<DateTime<Utc>> = a.groups[0].buckets.iter().map(|b| b.start).collect();
    let expected: Vec<DateTime<Utc>> = (1..=5)
        .rev()
        .map(|k| end() - TimeDelta::seconds(60 * k))
        .collect();
    assert_eq!(starts, expected);

    // Buckets [start, start + 60 s), oldest first: 300, 299 and 241 s before the end
    // fall in the first, 240 in the second, 61 in the fourth, 60 and 1 in the last;
    // the message at the end itself is not counted yet.
    let exact = |n: u64| (n, false);
    assert_eq!(
        processed(&a, APPLIES),
        [exact(3), exact(1), exact(0), exact(1), exact(2)]
    );
    let g = &a.groups[1];
    assert_eq!(g.processed_last_hour, Count::new(9, false));
    assert_eq!(g.processed_last_day, Count::new(10, false));
    assert_eq!(g.dead_lettered_last_day, Count::new(0, false));
    assert_eq!(
        dead(&a, REFUSES),
        [exact(0), exact(0), exact(0), exact(1), exact(1)]
    );
    let r = &a.groups[0];
    assert_eq!(r.dead_lettered_last_hour, Count::new(2, false));
    assert_eq!(r.dead_lettered_last_day, Count::new(3, false));
    assert_eq!(r.processed_last_day, Count::new(0, false));

    // A minute later the window has moved by one bucket.
    clock.set(end() + TimeDelta::seconds(60));
    let later = activity(&store, 100_000);
    assert_eq!(
        processed(&later, APPLIES),
        [exact(1), exact(0), exact(1), exact(2), exact(1)]
    );
}

fn a_read_that_stops_at_its_cap_makes_older_counts_lower_bounds<F: Fixture>(fx: &F) {
    let (store, _clock) = scene(fx);
    // The newest four: 1, 60, 61 and 240 s before the end. The bucket that starts
    // 240 s before the end may hold more (the read stopped at its start), the one
    // before it was not reached at all.
    let a = activity(&store, 4);
    assert_eq!(
        processed(&a, APPLIES),
        [(0, true), (1, true), (0, false), (1, false), (2, false)]
    );
    let g = a
        .groups
        .iter()
        .find(|g| g.consumer_group == APPLIES)
        .unwrap();
    assert_eq!(g.processed_last_hour, Count::new(4, true));
    assert_eq!(g.processed_last_day, Count::new(4, true));
    // Three dead letters are under the cap: exact.
    let r = a
        .groups
        .iter()
        .find(|g| g.consumer_group == REFUSES)
        .unwrap();
    assert_eq!(r.dead_lettered_last_day, Count::new(3, false));
    // A cap of one: only the newest bucket's entries are known, as a lower bound.
    let a = activity(&store, 1);
    assert_eq!(
        processed(&a, APPLIES),
        [(0, true), (0, true), (0, true), (0, true), (1, true)]
    );
}

fn a_query_out_of_range_is_refused_by_name<F: Fixture>(fx: &F) {
    let (store, _clock) = scene(fx);
    let operator = Operator::new(&store);
    let refused = |q: ActivityQuery| match operator.activity(&q) {
        Err(Error::InvalidSetting { setting, .. }) => setting,
        other => panic!("{q:?} gave {other:?}"),
    };
    assert_eq!(refused(query(1).buckets(0)), "buckets");
    assert_eq!(refused(query(1).buckets(1001)), "buckets");
    assert_eq!(
        refused(query(1).interval(Duration::from_millis(999))),
        "interval"
    );
    assert_eq!(refused(query(0)), "cap");
    // The defaults: 24 buckets of an hour.
    let a = operator.activity(&ActivityQuery::default()).unwrap();
    assert_eq!(a.interval_secs, 3600);
    assert!(a.groups.iter().all(|g| g.buckets.len() == 24));
    let g = a
        .groups
        .iter()
        .find(|g| g.consumer_group == APPLIES)
        .unwrap();
    // 3601 s before the end is in the 24 h window's second-newest bucket.
    assert_eq!(g.buckets[22].processed, Count::new(1, false));
    assert_eq!(g.buckets[23].processed, Count::new(9, false));
    assert_eq!(g.processed_last_day, Count::new(10, false));
}
