//! Retention under load, against real PostgreSQL and SQLite: purges that race each
//! other and a consumer delete every eligible row exactly once and nothing else; on
//! PostgreSQL the purge reads the retention index (never the whole table), a batch
//! never walks again over what earlier batches deleted, rows a running transaction
//! holds are skipped rather than waited for, and a purge that finds another one
//! running leaves the rows to it.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeSet;
use std::sync::Barrier;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel::PgConnection;
use inbox_core::{Envelope, ManualClock, MessageKey, OutboxMessage, OutboxStore};
use inbox_diesel::operator::Operator;
use inbox_diesel::{
    enqueue, purge_batch, PurgeTarget, Retention, Store, StoreConnection, PURGE_LOCK_CLASS,
};
use inbox_test_support::{group, start_time, usage, Fixture, Outcome, PgFixture, Recorder};

const GROUP: &str = "billing.daily-usage";
const PURGERS: usize = 4;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn hour() -> Retention {
    Retention::new(secs(3600), secs(3600), secs(600)).unwrap()
}

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Text)]
    state: String,
}

fn rows<C: Connection>(conn: &mut C, sql: &str) -> BTreeSet<(String, String)>
where
    Row: QueryableByName<C::Backend>,
    diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'static, C, Row>,
{
    diesel::sql_query(sql)
        .load::<Row>(conn)
        .unwrap()
        .into_iter()
        .map(|r| (r.key, r.state))
        .collect()
}

fn claims<F: Fixture>(fx: &F) -> BTreeSet<(String, String)>
where
    Row: QueryableByName<<F::Conn as Connection>::Backend>,
    diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'static, F::Conn, Row>,
{
    rows(
        &mut fx.connect(),
        "SELECT message_key AS key, status AS state FROM inbox_claims",
    )
}

fn batches(prefix: &str, n: usize) -> Vec<Vec<Envelope>> {
    (0..n)
        .collect::<Vec<_>>()
        .chunks(100)
        .map(|c| {
            c.iter()
                .map(|i| usage(&format!("{prefix}-{i}"), 1))
                .collect()
        })
        .collect()
}

/// `PURGERS` purges on threads of their own, started together with `beside` (a
/// consumer or a relay writing), each purging three times; every purge's count.
fn race<T: Send>(purge: impl Fn() -> u64 + Sync, beside: impl FnOnce() -> T + Send) -> Vec<u64> {
    let start = Barrier::new(PURGERS + 1);
    std::thread::scope(|s| {
        let purgers: Vec<_> = (0..PURGERS)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    (0..3).map(|_| purge()).collect::<Vec<u64>>()
                })
            })
            .collect();
        let writer = s.spawn(|| {
            start.wait();
            beside()
        });
        writer.join().unwrap();
        purgers
            .into_iter()
            .flat_map(|p| p.join().unwrap())
            .collect()
    })
}

inbox_test_support::on_both_backends!(
    racing_purges_delete_every_old_done_claim_once_and_nothing_else,
    racing_purges_delete_every_old_published_row_once_and_nothing_else,
    racing_purges_delete_every_old_discarded_letter_once_and_nothing_else,
);

fn racing_purges_delete_every_old_done_claim_once_and_nothing_else<F: Fixture>(fx: &F)
where
    Row: QueryableByName<<F::Conn as Connection>::Backend>,
    diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'static, F::Conn, Row>,
{
    let clock = ManualClock::new(start_time());
    let handler = Recorder::new(GROUP).behaviour(|key, _| {
        if key.starts_with("fail-") {
            Outcome::ApplyThenFail
        } else if key.starts_with("dead-") {
            Outcome::Permanent
        } else {
            Outcome::Apply
        }
    });
    let store = fx.open(
        fx.builder()
            .clock(std::sync::Arc::new(clock.clone()))
            .pool_size(PURGERS as u32 + 2)
            .handler(handler),
    );
    let g = group(GROUP);
    for b in batches("old", 3000)
        .into_iter()
        .chain(batches("fail", 50))
        .chain(batches("dead", 50))
    {
        store.process_batch(&g, &b).unwrap();
    }
    // Old claims a redelivery started (crash-loop marks): kept like failed and dead.
    let started: Vec<String> = (0..3000)
        .filter(|i| i % 50 == 3)
        .map(|i| format!("'old-{i}'"))
        .collect();
    fx.execute(&format!(
        "UPDATE inbox_claims SET status = 'started' WHERE message_key IN ({})",
        started.join(", ")
    ));
    clock.advance(secs(7200));
    for b in batches("recent", 300) {
        store.process_batch(&g, &b).unwrap();
    }
    let before = claims(fx);
    let eligible: BTreeSet<(String, String)> = before
        .iter()
        .filter(|(k, s)| k.starts_with("old-") && s == "done")
        .cloned()
        .collect();
    assert_eq!(eligible.len(), 3000 - started.len());
    // The dry-run count is the purge's own: these rows, not the started, failed,
    // dead or recent ones.
    let hour_ago = inbox_core::Clock::now(&clock) - chrono::TimeDelta::hours(1);
    let count = |target| {
        inbox_diesel::count_purgeable(&mut *store.connection().unwrap(), target, hour_ago).unwrap()
    };
    assert_eq!(count(PurgeTarget::DoneClaims), eligible.len() as u64);
    let report = Operator::new(&store)
        .count_purgeable(&hour(), secs(3600))
        .unwrap();
    assert_eq!(report.done_claims, eligible.len() as u64);

    // The consumer keeps writing claims (newer than the window) while they purge.
    let counts = race(
        || store.purge_done_claims(&hour(), 50).unwrap(),
        || {
            for b in batches("live", 1000) {
                store.process_batch(&g, &b).unwrap();
            }
        },
    );

    assert_eq!(
        counts.iter().sum::<u64>(),
        eligible.len() as u64,
        "every eligible claim deleted once: {counts:?}"
    );
    let after = claims(fx);
    let expected: BTreeSet<(String, String)> = before
        .difference(&eligible)
        .cloned()
        .chain((0..1000).map(|i| (format!("live-{i}"), "done".to_owned())))
        .collect();
    assert_eq!(
        after, expected,
        "only the old done claims are gone: started, failed, dead and recent ones stay"
    );
}

fn enqueue_all<C: StoreConnection>(store: &Store<C>, prefix: &str, n: usize) -> Vec<i64> {
    let conn: &mut C = &mut store.connection().unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let message = OutboxMessage::new(
            MessageKey::new(format!("{prefix}-{i}")).unwrap(),
            "billing",
            "usage.recorded",
            b"{}".to_vec(),
        );
        match conn
            .transaction(|conn| enqueue(conn, &message, store.clock().now()))
            .unwrap()
        {
            inbox_core::EnqueueOutcome::Enqueued { id } => ids.push(id),
            other => panic!("expected a new row, found {other:?}"),
        }
    }
    ids
}

/// Enqueues `n` rows and publishes them (as a relay does).
fn publish<C: StoreConnection>(store: &Store<C>, relay: &str, prefix: &str, n: usize) {
    let ids = enqueue_all(store, prefix, n);
    let lease = store.lease(relay, n, secs(3 * 3600)).unwrap();
    assert_eq!(lease.rows.len(), n);
    assert_eq!(store.mark_published(relay, &ids).unwrap(), n);
}

fn racing_purges_delete_every_old_published_row_once_and_nothing_else<F: Fixture>(fx: &F)
where
    Row: QueryableByName<<F::Conn as Connection>::Backend>,
    diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'static, F::Conn, Row>,
{
    let clock = ManualClock::new(start_time());
    let store = fx
        .builder()
        .clock(std::sync::Arc::new(clock.clone()))
        .pool_size(PURGERS as u32 + 2)
        .build()
        .unwrap();
    publish(&store, "relay-1", "old", 1500);
    enqueue_all(&store, "unpublished", 50);
    clock.advance(secs(7200));
    // A relay's lease that outlives the purges: the new rows stay unpublished.
    let lease = store.lease("relay-1", 50, secs(3 * 3600)).unwrap();
    assert_eq!(lease.rows.len(), 50);
    publish(&store, "relay-2", "recent", 100);
    let outbox = |fx: &F| {
        rows(
            &mut fx.connect(),
            "SELECT message_key AS key, CASE WHEN published_at IS NULL THEN 'no' ELSE 'yes' END AS state FROM outbox_messages",
        )
    };
    let before = outbox(fx);
    // The dry-run count: the old published rows, not the leased or recent ones.
    let hour_ago = inbox_core::Clock::now(&clock) - chrono::TimeDelta::hours(1);
    assert_eq!(
        inbox_diesel::count_purgeable(
            &mut *store.connection().unwrap(),
            PurgeTarget::PublishedOutboxRows,
            hour_ago
        )
        .unwrap(),
        1500
    );

    // A relay keeps publishing (newer than the window) while they purge.
    let counts = race(
        || store.purge_published(&hour(), 50).unwrap(),
        || {
            for round in 0..10 {
                publish(&store, "relay-3", &format!("live{round}"), 50);
            }
        },
    );

    assert_eq!(
        counts.iter().sum::<u64>(),
        1500,
        "every old published row deleted once: {counts:?}"
    );
    let expected: BTreeSet<(String, String)> = before
        .into_iter()
        .filter(|(k, _)| !k.starts_with("old-"))
        .chain((0..10).flat_map(|r| (0..50).map(move |i| (format!("live{r}-{i}"), "yes".into()))))
        .collect();
    assert_eq!(outbox(fx), expected, "unpublished and recent rows stay");
}

fn letters<C: Connection>(conn: &mut C) -> BTreeSet<(String, String)>
where
    Row: QueryableByName<C::Backend>,
    diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'static, C, Row>,
{
    rows(
        conn,
        "SELECT message_key AS key, CASE WHEN discarded_at IS NULL THEN 'pending' ELSE 'discarded' END AS state FROM inbox_dead_letters",
    )
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Dead-letters `n` messages under `prefix` and discards those `discard` picks.
fn dead_letters<F: Fixture>(
    fx: &F,
    store: &Store<F::Conn>,
    prefix: &str,
    n: usize,
    discard: impl Fn(usize) -> bool,
) where
    Id: QueryableByName<<F::Conn as Connection>::Backend>,
    diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'static, F::Conn, Id>,
{
    let g = group(GROUP);
    for b in batches(prefix, n) {
        store.process_batch(&g, &b).unwrap();
    }
    let mut conn = fx.connect();
    for i in (0..n).filter(|i| discard(*i)) {
        let id: Id = diesel::sql_query(format!(
            "SELECT id FROM inbox_dead_letters WHERE message_key = '{prefix}-{i}'"
        ))
        .get_result(&mut conn)
        .unwrap();
        assert_eq!(
            Operator::new(store).discard_dead_letter(id.id).unwrap(),
            inbox_diesel::operator::DiscardOutcome::Discarded
        );
    }
}

fn racing_purges_delete_every_old_discarded_letter_once_and_nothing_else<F: Fixture + Sync>(fx: &F)
where
    Row: QueryableByName<<F::Conn as Connection>::Backend>,
    Id: QueryableByName<<F::Conn as Connection>::Backend>,
    diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'static, F::Conn, Row>
        + diesel::query_dsl::LoadQuery<'static, F::Conn, Id>,
{
    let clock = ManualClock::new(start_time());
    let handler = Recorder::new(GROUP).behaviour(|_, _| Outcome::Permanent);
    let store = fx.open(
        fx.builder()
            .clock(std::sync::Arc::new(clock.clone()))
            .pool_size(PURGERS as u32 + 2)
            .handler(handler),
    );
    dead_letters(fx, &store, "old", 600, |i| i % 6 != 0);
    clock.advance(secs(7200));
    dead_letters(fx, &store, "recent", 100, |i| i % 2 == 0);
    let before = letters(&mut fx.connect());
    let old = |k: &str, s: &str| k.starts_with("old-") && s == "discarded";
    let eligible = before.iter().filter(|(k, s)| old(k, s)).count();
    assert_eq!(eligible, 500);
    // The dry-run count: the old discarded letters, not the pending or recent ones.
    let report = Operator::new(&store)
        .count_purgeable(&hour(), secs(3600))
        .unwrap();
    assert_eq!(report.discarded_dead_letters, 500);

    // Letters keep arriving and being discarded (newer than the window) meanwhile.
    let counts = race(
        || {
            Operator::new(&store)
                .purge_discarded_dead_letters(secs(3600), 50)
                .unwrap()
        },
        || dead_letters(fx, &store, "live", 300, |i| i % 3 == 0),
    );

    assert_eq!(
        counts.iter().sum::<u64>(),
        500,
        "every old discarded letter deleted once: {counts:?}"
    );
    let expected: BTreeSet<(String, String)> = before
        .into_iter()
        .filter(|(k, s)| !old(k, s))
        .chain((0..300).map(|i| {
            let state = if i % 3 == 0 { "discarded" } else { "pending" };
            (format!("live-{i}"), state.to_owned())
        }))
        .collect();
    assert_eq!(
        letters(&mut fx.connect()),
        expected,
        "pending letters and recent discards stay"
    );
}

// PostgreSQL: plans, dead rows, row locks and the purge lock.

/// Fills the fixture's claims: `old` done claims an hour and more before the cutoff
/// (one per millisecond), `recent` done claims after it, and `other` failed,
/// started and dead claims as old as the oldest done ones.
fn fill_claims(fx: &PgFixture, old: i64, recent: i64, other: i64) {
    fx.execute(&format!(
        "INSERT INTO inbox_claims (consumer_group, message_key, message_type, payload_digest,
             status, first_seen_at, updated_at)
         SELECT '{GROUP}', 'old-' || i, 'usage.recorded', '\\x00', 'done',
             '2026-01-01'::timestamptz + i * interval '1 ms',
             '2026-01-01'::timestamptz + i * interval '1 ms'
         FROM generate_series(1, {old}) i;
         INSERT INTO inbox_claims (consumer_group, message_key, message_type, payload_digest,
             status, first_seen_at, updated_at)
         SELECT '{GROUP}', 'recent-' || i, 'usage.recorded', '\\x00', 'done',
             '2026-03-01'::timestamptz + i * interval '1 ms',
             '2026-03-01'::timestamptz + i * interval '1 ms'
         FROM generate_series(1, {recent}) i;
         INSERT INTO inbox_claims (consumer_group, message_key, message_type, payload_digest,
             status, first_seen_at, updated_at)
         SELECT '{GROUP}', 'other-' || i, 'usage.recorded', '\\x00',
             (ARRAY['failed', 'started', 'dead'])[1 + i % 3],
             '2026-01-01'::timestamptz, '2026-01-01'::timestamptz + i * interval '1 ms'
         FROM generate_series(1, {other}) i;
         ANALYZE inbox_claims;"
    ));
}

fn cutoff() -> chrono::DateTime<chrono::Utc> {
    "2026-02-01T00:00:00Z".parse().unwrap()
}

#[derive(QueryableByName)]
struct Plan {
    #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
    text: String,
}

#[derive(QueryableByName)]
struct Text1 {
    #[diesel(sql_type = Text)]
    text: String,
}

/// Every plan node of a JSON plan, depth first.
fn nodes<'a>(plan: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
    out.push(plan);
    if let Some(children) = plan.get("Plans").and_then(|p| p.as_array()) {
        for child in children {
            nodes(child, out);
        }
    }
}

#[test]
fn the_claim_purge_reads_the_retention_index_never_the_whole_table() {
    let Some(fx) = PgFixture::new() else { return };
    let _store = fx.open(fx.builder());
    fill_claims(&fx, 120_000, 40_000, 15_000);
    let mut conn = fx.connect();

    // The index the purge relies on: partial, done claims only, by updated_at.
    let index: Text1 = diesel::sql_query(
        "SELECT pg_get_indexdef(i.indexrelid) AS text FROM pg_index i
         JOIN pg_class c ON c.oid = i.indexrelid
         WHERE i.indrelid = 'inbox_claims'::regclass AND c.relname = 'inbox_claims_done'",
    )
    .get_result(&mut conn)
    .unwrap();
    assert!(
        index
            .text
            .ends_with("USING btree (updated_at) WHERE (status = 'done'::text)"),
        "retention index: {}",
        index.text
    );

    assert_plan_reads_index(
        &mut conn,
        PurgeTarget::DoneClaims,
        "inbox_claims",
        "inbox_claims_done",
    );
}

/// The planner's own choice (enable_seqscan as the server has it) for `target`'s
/// purge statement, for a first batch and for a later one (starting where the
/// previous stopped): an index scan of `index`, no sequential scan of `table`.
fn assert_plan_reads_index(conn: &mut PgConnection, target: PurgeTarget, table: &str, index: &str) {
    conn.batch_execute(&format!(
        "DEALLOCATE ALL; PREPARE purge (timestamptz, bigint, timestamptz) AS {}",
        inbox_diesel::pg_purge_statement(target)
    ))
    .unwrap();
    for from in ["NULL", "'2026-01-01 00:01:00+00'"] {
        let plan: Plan = diesel::sql_query(format!(
            "EXPLAIN (FORMAT JSON) EXECUTE purge('{}', 1000, {from})",
            cutoff().to_rfc3339()
        ))
        .get_result(conn)
        .unwrap();
        let json: serde_json::Value = serde_json::from_str(&plan.text).unwrap();
        let mut all = Vec::new();
        nodes(&json[0]["Plan"], &mut all);
        let on_table: Vec<&serde_json::Value> = all
            .into_iter()
            .filter(|n| n["Relation Name"] == table)
            .collect();
        assert!(
            on_table.iter().all(|n| n["Node Type"] != "Seq Scan"),
            "a sequential scan of {table}: {}",
            plan.text
        );
        assert!(
            on_table.iter().any(|n| {
                matches!(
                    n["Node Type"].as_str(),
                    Some("Index Scan" | "Index Only Scan")
                ) && n["Index Name"] == index
            }),
            "no index scan of {index}: {}",
            plan.text
        );
    }
}

#[test]
fn the_outbox_and_letter_purges_read_their_indexes_never_the_whole_table() {
    let Some(fx) = PgFixture::new() else { return };
    let _store = fx.open(fx.builder());
    // Old rows, a fifth unpublished (or a quarter pending), and recent ones.
    fx.execute(
        "INSERT INTO outbox_messages (message_key, exchange, routing_key, message_type,
             payload, headers, created_at, available_at, published_at)
         SELECT 'row-' || i, 'billing', 'usage', 'usage.recorded', '\\x00', '{}', t, t,
             CASE WHEN i % 5 = 0 THEN NULL ELSE t END
         FROM generate_series(1, 150000) i,
              LATERAL (SELECT CASE WHEN i % 4 = 0 THEN '2026-03-01'::timestamptz
                  ELSE '2026-01-01'::timestamptz END + i * interval '1 ms' AS t) at;
         INSERT INTO inbox_dead_letters (consumer_group, message_key, message_type, payload,
             headers, attempts, reason, dead_lettered_at, discarded_at)
         SELECT 'billing.daily-usage', 'letter-' || i, 'usage.recorded', '\\x00', '{}', 1,
             'permanent', t, CASE WHEN i % 4 = 0 THEN NULL ELSE t END
         FROM generate_series(1, 150000) i,
              LATERAL (SELECT CASE WHEN i % 3 = 0 THEN '2026-03-01'::timestamptz
                  ELSE '2026-01-01'::timestamptz END + i * interval '1 ms' AS t) at;
         ANALYZE outbox_messages; ANALYZE inbox_dead_letters;",
    );
    let mut conn = fx.connect();
    assert_plan_reads_index(
        &mut conn,
        PurgeTarget::PublishedOutboxRows,
        "outbox_messages",
        "outbox_messages_published",
    );
    assert_plan_reads_index(
        &mut conn,
        PurgeTarget::DiscardedDeadLetters,
        "inbox_dead_letters",
        "inbox_dead_letters_discarded",
    );
}

#[derive(QueryableByName)]
struct Blocks {
    #[diesel(sql_type = BigInt)]
    blocks: i64,
}

/// Buffers this backend's current transaction touched in the claims table and its
/// retention index (counted as the statements run).
fn blocks(conn: &mut PgConnection) -> i64 {
    diesel::sql_query(
        "SELECT (pg_stat_get_xact_blocks_fetched('inbox_claims'::regclass)
               + pg_stat_get_xact_blocks_fetched('inbox_claims_done'::regclass))::bigint AS blocks",
    )
    .get_result::<Blocks>(conn)
    .unwrap()
    .blocks
}

#[test]
fn a_purge_batch_never_walks_again_over_what_earlier_batches_deleted() {
    let Some(fx) = PgFixture::new() else { return };
    let _store = fx.open(fx.builder());
    fill_claims(&fx, 30_000, 1_000, 0);
    // A long transaction elsewhere (a report, a backup) keeps the deleted rows
    // visible to it: vacuum cannot remove them, nor can a scan mark them dead in the
    // index, so a batch that started from the oldest row again would visit each.
    let mut reader = fx.connect();
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM inbox_claims")
        .unwrap();

    let mut conn = fx.connect();
    let (mut from, mut per_batch, mut deleted) = (None, Vec::new(), 0);
    loop {
        let (batch, touched) = conn
            .transaction(|conn| {
                let start = blocks(conn);
                let batch = purge_batch(conn, PurgeTarget::DoneClaims, cutoff(), 1000, from)?;
                Ok::<_, inbox_diesel::Error>((batch, blocks(conn) - start))
            })
            .unwrap();
        deleted += batch.deleted;
        if batch.deleted < 1000 {
            break;
        }
        per_batch.push(touched);
        from = batch.resume_from;
    }
    reader.batch_execute("ROLLBACK").unwrap();
    assert_eq!(deleted, 30_000);
    let (first, last) = (per_batch[0], per_batch[per_batch.len() - 1]);
    // Each batch touches a few buffers per row it deletes (about 4,000 here);
    // walking again over the rows deleted before adds their heap pages (about 17 more
    // per batch of 1,000 here, some 500 by the last batch). The last batch may touch
    // at most 1% more than the first.
    assert!(
        last * 100 <= first * 101,
        "buffers per batch grew with the rows deleted before it: first {first}, last {last}, \
         all {per_batch:?}"
    );
}

#[test]
fn a_purge_skips_claims_a_running_transaction_holds_instead_of_waiting() {
    let Some(fx) = PgFixture::new() else { return };
    // Without SKIP LOCKED the purge would wait for the holder: the statement
    // timeout turns that wait into an error.
    let store = fx.open(fx.builder().statement_timeout(secs(5)));
    fill_claims(&fx, 500, 0, 0);
    let mut holder = fx.connect();
    holder
        .batch_execute(
            "BEGIN; SELECT 1 FROM inbox_claims WHERE message_key IN ('old-1', 'old-250') FOR UPDATE",
        )
        .unwrap();
    let retention = Retention::new(secs(0), secs(3600), secs(600)).unwrap();
    let purged = store.purge_done_claims(&retention, 100);
    holder.batch_execute("ROLLBACK").unwrap();
    assert_eq!(purged.unwrap(), 498, "every claim but the two held");
    let left = claims(&fx);
    assert_eq!(
        left.into_iter().map(|(k, _)| k).collect::<BTreeSet<_>>(),
        BTreeSet::from(["old-1".to_owned(), "old-250".to_owned()])
    );
    // The next purge takes them.
    assert_eq!(store.purge_done_claims(&retention, 100).unwrap(), 2);
}

#[test]
fn a_purge_that_finds_another_running_leaves_the_rows_to_it() {
    let Some(fx) = PgFixture::new() else { return };
    let store = fx.open(fx.builder());
    fill_claims(&fx, 300, 0, 0);
    let retention = Retention::new(secs(0), secs(3600), secs(600)).unwrap();
    // Another instance's purge of claims, mid-batch: it holds the purge lock.
    let mut other = fx.connect();
    let lock = format!("({PURGE_LOCK_CLASS}, 'inbox_claims'::regclass::oid::int4)");
    other
        .batch_execute(&format!("SELECT pg_advisory_lock{lock}"))
        .unwrap();
    assert_eq!(
        store.purge_done_claims(&retention, 100).unwrap(),
        0,
        "a second purge stops at once"
    );
    assert_eq!(claims(&fx).len(), 300, "and deletes nothing");
    other
        .batch_execute(&format!("SELECT pg_advisory_unlock{lock}"))
        .unwrap();
    assert_eq!(store.purge_done_claims(&retention, 100).unwrap(), 300);
}
