//! The stored failure group on both backends: every path that dead-letters writes it
//! equal to the fingerprint of its reason, type and error; the backfill fills letters
//! written without it, once; the operator's filter and grouping, now in SQL, answer
//! as a recomputation in Rust over many varied letters does; and on PostgreSQL a
//! filter by failure group reads its index.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::{QueryableByName, RunQueryDsl};
use inbox_core::{DeadLetterReason, Decision, InboxStore, ManualClock, RetryPolicy};
use inbox_diesel::operator::{
    failure_fingerprint, DeadLetterFilter, FailureGroup, LetterStatus, Operator, SAMPLE_ERROR_CHARS,
};
use inbox_diesel::Store;
use inbox_test_support::{group, on_both_backends, usage, Fixture, Outcome, Recorder};

const GROUP: &str = "billing.daily-usage";

fn start() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 3, 1, 12, 0, 0).unwrap()
}

#[derive(QueryableByName, Debug)]
struct StoredLetter {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    reason: String,
    #[diesel(sql_type = Text)]
    message_type: String,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    failure_group: Option<String>,
}

/// The raw letter rows, read by each backend's own connection type.
trait RawLetters {
    fn letters(&mut self) -> Vec<StoredLetter>;
}

macro_rules! raw_letters {
    ($conn:ty) => {
        impl RawLetters for $conn {
            fn letters(&mut self) -> Vec<StoredLetter> {
                diesel::sql_query(
                    "SELECT id, reason, message_type, last_error, failure_group \
                     FROM inbox_dead_letters ORDER BY id",
                )
                .load(self)
                .unwrap()
            }
        }
    };
}

raw_letters!(diesel::PgConnection);
raw_letters!(diesel::SqliteConnection);

fn stored<F: Fixture>(fx: &F) -> Vec<StoredLetter>
where
    F::Conn: RawLetters,
{
    fx.connect().letters()
}

/// Every letter's stored fingerprint is the one its reason, type and error give.
fn assert_fingerprints_stored<F: Fixture>(fx: &F) -> Vec<StoredLetter>
where
    F::Conn: RawLetters,
{
    let letters = stored(fx);
    for l in &letters {
        assert_eq!(
            l.failure_group.as_deref(),
            Some(failure_fingerprint(&l.reason, &l.message_type, l.last_error.as_deref()).as_str()),
            "{l:?}"
        );
    }
    letters
}

on_both_backends!(
    every_path_that_dead_letters_stores_the_fingerprint,
    the_backfill_fills_letters_written_without_a_fingerprint_once,
    filter_and_grouping_answer_as_a_recomputation_does,
    verify_schema_refuses_a_store_without_the_operator_reads_objects,
    two_stores_built_at_once_backfill_every_letter_once,
);

fn every_path_that_dead_letters_stores_the_fingerprint<F: Fixture>(fx: &F)
where
    F::Conn: RawLetters,
{
    let clock = Arc::new(ManualClock::new(start()));
    let handler = Recorder::new(GROUP)
        .policy(RetryPolicy::new(2, Duration::from_secs(1), Duration::from_secs(1)).unwrap())
        .behaviour(|key, _| match key {
            k if k.starts_with("retry") => {
                Outcome::FailWith(format!("ledger row {} locked", k.len()))
            }
            k if k.starts_with("perm") => Outcome::Permanent,
            k if k.starts_with("data") => {
                Outcome::Sql("INSERT INTO effects (message_key, amount) VALUES (NULL, 1)")
            }
            k if k.starts_with("crash") => Outcome::FailWith("first failure".to_owned()),
            _ => Outcome::Apply,
        });
    let store = fx.open(
        fx.builder()
            .clock(clock.clone())
            .crash_limit(2)
            .handler(handler),
    );
    let g = group(GROUP);
    let run = |envs: &[inbox_core::Envelope]| store.process_batch(&g, envs).unwrap();

    // max_attempts: two handled failures.
    run(&[usage("retry-1", 1)]);
    clock.advance(Duration::from_secs(2));
    run(&[usage("retry-1", 1)]);
    // permanent, decode_error, and a collision with a done claim.
    run(&[usage("perm-1", 1)]);
    let mut undecodable = usage("decode-1", 1);
    undecodable.payload = b"not json".to_vec();
    run(&[undecodable]);
    run(&[usage("done-1", 1)]);
    run(&[usage("done-1", 2)]);
    // The isolated path: a data error splits the batch until the delivery is alone.
    run(&[usage("data-1", 1), usage("fine-1", 1)]);
    // A crash loop: a failed claim that then gathered starts without an outcome.
    run(&[usage("crash-1", 1)]);
    fx.execute(
        "UPDATE inbox_claims SET status = 'started', starts = 2, next_attempt_at = NULL \
         WHERE message_key = 'crash-1'",
    );
    assert_eq!(
        run(&[usage("crash-1", 1).redelivered()]),
        [Decision::DeadLettered(DeadLetterReason::CrashLoop)]
    );
    // The broker's dead letters: a delivery limit, and a malformed delivery.
    store
        .dead_letter(
            &g,
            &usage("limit-1", 1),
            DeadLetterReason::DeliveryLimit,
            "limit 20",
        )
        .unwrap();
    let mut unstorable = usage("nul-1", 1);
    unstorable.tenant = Some("ac\0me".to_owned());
    store
        .dead_letter(
            &g,
            &unstorable,
            DeadLetterReason::Malformed,
            "frame 7 unreadable",
        )
        .unwrap();

    let letters = assert_fingerprints_stored(fx);
    let reasons: BTreeSet<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
    for reason in [
        "max_attempts",
        "permanent",
        "decode_error",
        "key_collision",
        "crash_loop",
        "delivery_limit",
        "malformed",
    ] {
        assert!(
            reasons.contains(reason),
            "no {reason} letter in {reasons:?}"
        );
    }
    // The isolated path dead-lettered or counted the data error: either way every
    // letter it wrote carries its fingerprint (checked above).
    // Listing reads the stored column.
    let listed = Operator::new(&store)
        .list_dead_letters(&DeadLetterFilter::default(), 0, 100)
        .unwrap();
    assert_eq!(listed.len(), letters.len());
    for e in listed {
        let l = letters.iter().find(|l| l.id == e.id).unwrap();
        assert_eq!(Some(&e.failure_group), l.failure_group.as_ref());
    }
}

/// Copies `letter`'s row `n` times with other keys and errors, leaving their failure
/// group NULL, as rows written before the column existed have it.
fn copies_without_fingerprint<F: Fixture>(fx: &F, n: usize, error: &str) {
    for i in 0..n {
        fx.execute(&format!(
            "INSERT INTO inbox_dead_letters (consumer_group, message_key, message_type, \
             tenant, payload, headers, attempts, reason, last_error, dead_lettered_at) \
             SELECT consumer_group, message_key || '-old-{i}', message_type, tenant, payload, \
             headers, attempts, reason, '{error} {i}', dead_lettered_at \
             FROM inbox_dead_letters WHERE id = (SELECT MIN(id) FROM inbox_dead_letters)"
        ));
    }
}

fn the_backfill_fills_letters_written_without_a_fingerprint_once<F: Fixture>(fx: &F)
where
    F::Conn: RawLetters,
{
    let store = fx.open(fx.builder());
    let g = group(GROUP);
    store
        .dead_letter(
            &g,
            &usage("first", 1),
            DeadLetterReason::DeliveryLimit,
            "limit",
        )
        .unwrap();
    // More than one backfill batch (500) of letters without a fingerprint.
    let before = stored(fx);
    for _ in 0..6 {
        copies_without_fingerprint(fx, 100, "order 9 of user 3 failed");
    }
    // A stored fingerprint is never rewritten, even a wrong one.
    fx.execute("UPDATE inbox_dead_letters SET failure_group = 'ffffffffffffffff' WHERE message_key = 'first'");
    let total = stored(fx).len();
    assert!(total > 600);
    assert!(
        stored(fx)
            .iter()
            .filter(|l| l.failure_group.is_none())
            .count()
            > 500
    );
    drop(store);

    // Building the store again runs the backfill in its migration step.
    let store = fx.open(fx.builder());
    let after = stored(fx);
    assert_eq!(after.len(), total);
    for l in &after {
        if l.id == before[0].id {
            assert_eq!(l.failure_group.as_deref(), Some("ffffffffffffffff"));
        } else {
            assert_eq!(
                l.failure_group.as_deref(),
                Some(
                    failure_fingerprint(&l.reason, &l.message_type, l.last_error.as_deref())
                        .as_str()
                ),
                "{l:?}"
            );
        }
    }
    // The copies' masked errors are one group ("order <n> of user <n> failed").
    let groups = Operator::new(&store)
        .failure_groups(&DeadLetterFilter::default())
        .unwrap();
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert_eq!(groups[0].count as usize, total - 1);
    drop(store);

    // Again: nothing left to fill, nothing rewritten.
    let _store = fx.open(fx.builder());
    let again = stored(fx);
    assert_eq!(
        again
            .iter()
            .map(|l| (l.id, l.failure_group.clone()))
            .collect::<Vec<_>>(),
        after
            .iter()
            .map(|l| (l.id, l.failure_group.clone()))
            .collect::<Vec<_>>()
    );
}

/// A deterministic stream of small numbers.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

/// `n` letters of varied groups, reasons, types, errors (numbered, with ids, long,
/// none), times and statuses, inserted with no fingerprint.
fn varied_letters<F: Fixture>(fx: &F, n: usize, seed: u64) {
    let mut rng = Lcg(seed);
    let groups = ["billing.daily-usage", "billing.audit", "mail.send"];
    let reasons = [
        "max_attempts",
        "permanent",
        "decode_error",
        "crash_loop",
        "delivery_limit",
    ];
    let types = ["usage.recorded", "usage.refunded"];
    let mut values = Vec::new();
    for i in 0..n {
        let error = match rng.next(6) {
            0 => "NULL".to_owned(),
            1 => format!(
                "'ledger row {} locked: timeout after {}s'",
                rng.next(1000),
                rng.next(60)
            ),
            2 => format!(
                "'key {:08x}-aaaa-bbbb-cccc-{:012x} is taken'",
                rng.next(1 << 31),
                rng.next(1 << 40)
            ),
            3 => format!("'refused\nstack line {}'", rng.next(9)),
            4 => format!(
                "'{}'",
                "x".repeat(SAMPLE_ERROR_CHARS + 50 + rng.next(20) as usize)
            ),
            _ => "'timeout'".to_owned(),
        };
        let at = start() - chrono::Duration::seconds(rng.next(5000) as i64);
        let discarded = if rng.next(5) == 0 {
            format!("'{}'", at.format("%Y-%m-%d %H:%M:%S+00:00"))
        } else {
            "NULL".to_owned()
        };
        let replayed = if rng.next(4) == 0 {
            format!("'{}'", at.format("%Y-%m-%d %H:%M:%S+00:00"))
        } else {
            "NULL".to_owned()
        };
        values.push(format!(
            "('{}', 'k-{seed}-{i}', '{}', NULL, '{{}}', 1, '{}', {error}, '{}', {replayed}, {discarded})",
            groups[rng.next(3) as usize],
            types[rng.next(2) as usize],
            reasons[rng.next(5) as usize],
            at.format("%Y-%m-%d %H:%M:%S+00:00"),
        ));
    }
    // The payload is copied from a real letter (a BLOB/BYTEA literal differs between
    // the backends).
    fx.execute(&format!(
        "CREATE TEMP TABLE v (consumer_group TEXT, message_key TEXT, message_type TEXT, \
         tenant TEXT, headers TEXT, attempts INTEGER, reason TEXT, last_error TEXT, \
         dead_lettered_at TEXT, replayed_at TEXT, discarded_at TEXT); \
         INSERT INTO v VALUES {}; \
         INSERT INTO inbox_dead_letters (consumer_group, message_key, message_type, tenant, \
         payload, headers, attempts, reason, last_error, dead_lettered_at, replayed_at, \
         discarded_at) \
         SELECT v.consumer_group, v.message_key, v.message_type, v.tenant, d.payload, \
         v.headers, v.attempts, v.reason, v.last_error, {cast}, {cast_r}, {cast_d} \
         FROM v, inbox_dead_letters d WHERE d.id = (SELECT MIN(id) FROM inbox_dead_letters)",
        values.join(", "),
        cast = stamp::<F>("v.dead_lettered_at"),
        cast_r = stamp::<F>("v.replayed_at"),
        cast_d = stamp::<F>("v.discarded_at"),
    ));
}

/// A text column as the backend's timestamp column takes it.
fn stamp<F: Fixture>(column: &str) -> String {
    if std::any::type_name::<F::Conn>().contains("Pg") {
        format!("CAST({column} AS TIMESTAMPTZ)")
    } else {
        column.to_owned()
    }
}

/// The failure groups of `filter` recomputed in Rust from the listed letters.
/// A failure group as the comparison sees it: fingerprint, count, consumer groups,
/// first and last seen, sample error, message type.
type Shown = (
    String,
    u64,
    Vec<String>,
    DateTime<Utc>,
    DateTime<Utc>,
    Option<String>,
    String,
);

/// A group being recomputed: count, consumer groups, first and last seen, sample
/// error, message type.
type Recomputing = (
    u64,
    BTreeSet<String>,
    DateTime<Utc>,
    DateTime<Utc>,
    Option<String>,
    String,
);

fn recomputed(
    operator: &Operator<impl inbox_diesel::operator::OperatorConnection>,
    filter: &DeadLetterFilter,
) -> Vec<Shown> {
    let letters = operator.list_dead_letters(filter, 0, usize::MAX).unwrap();
    let mut groups: BTreeMap<String, Recomputing> = BTreeMap::new();
    // Newest first: the first letter of a group is its sample.
    for l in letters {
        let fp = failure_fingerprint(l.reason.as_str(), &l.message_type, l.last_error.as_deref());
        let sample = l
            .last_error
            .as_deref()
            .map(|e| e.chars().take(SAMPLE_ERROR_CHARS).collect());
        let g = groups.entry(fp).or_insert_with(|| {
            (
                0,
                BTreeSet::new(),
                l.dead_lettered_at,
                l.dead_lettered_at,
                sample,
                l.message_type.clone(),
            )
        });
        g.0 += 1;
        g.1.insert(l.consumer_group.clone());
        g.2 = g.2.min(l.dead_lettered_at);
        g.3 = g.3.max(l.dead_lettered_at);
    }
    let mut out: Vec<_> = groups
        .into_iter()
        .map(|(fp, (n, members, first, last, sample, ty))| {
            (
                fp,
                n,
                members.into_iter().collect(),
                first,
                last,
                sample,
                ty,
            )
        })
        .collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then(b.4.cmp(&a.4)).then(a.0.cmp(&b.0)));
    out
}

fn shown(groups: &[FailureGroup]) -> Vec<Shown> {
    groups
        .iter()
        .map(|g| {
            (
                g.fingerprint.clone(),
                g.count,
                g.consumer_groups.clone(),
                g.first_seen,
                g.last_seen,
                g.sample_error.clone(),
                g.message_type.clone(),
            )
        })
        .collect()
}

fn filters() -> Vec<DeadLetterFilter> {
    vec![
        DeadLetterFilter::default(),
        DeadLetterFilter::default().consumer_group("billing.audit"),
        DeadLetterFilter::default().reason(DeadLetterReason::MaxAttempts),
        DeadLetterFilter::default().status(LetterStatus::Pending),
        DeadLetterFilter::default().status(LetterStatus::Discarded),
        DeadLetterFilter::default()
            .message_type("usage.refunded")
            .since(start() - chrono::Duration::seconds(2500)),
    ]
}

/// The groups of every filter against a recomputation; with `listing`, each group's
/// own filter lists exactly its letters, paged in SQL (only once every letter has
/// its fingerprint stored: the filter does not find a letter an older binary wrote
/// until the backfill has run).
fn check_against_recomputation<C: inbox_diesel::operator::OperatorConnection>(
    store: &Store<C>,
    listing: bool,
) {
    let operator = Operator::new(store);
    for filter in filters() {
        let groups = operator.failure_groups(&filter).unwrap();
        assert_eq!(shown(&groups), recomputed(&operator, &filter), "{filter:?}");
        if !listing {
            continue;
        }
        for g in groups.iter().take(8) {
            let by_group = filter.clone().failure_group(g.fingerprint.clone());
            let all = operator.list_dead_letters(&filter, 0, usize::MAX).unwrap();
            let expected: Vec<i64> = all
                .iter()
                .filter(|l| {
                    failure_fingerprint(l.reason.as_str(), &l.message_type, l.last_error.as_deref())
                        == g.fingerprint
                })
                .map(|l| l.id)
                .collect();
            assert_eq!(expected.len() as u64, g.count);
            let listed: Vec<i64> = operator
                .list_dead_letters(&by_group, 0, usize::MAX)
                .unwrap()
                .iter()
                .map(|l| l.id)
                .collect();
            assert_eq!(listed, expected);
            let page: Vec<i64> = operator
                .list_dead_letters(&by_group, 2, 3)
                .unwrap()
                .iter()
                .map(|l| l.id)
                .collect();
            assert_eq!(
                page,
                expected.iter().skip(2).take(3).copied().collect::<Vec<_>>()
            );
            assert_eq!(operator.failure_groups(&by_group).unwrap().len(), 1);
        }
    }
}

fn filter_and_grouping_answer_as_a_recomputation_does<F: Fixture>(fx: &F)
where
    F::Conn: RawLetters,
{
    let store = fx.open(fx.builder());
    store
        .dead_letter(
            &group(GROUP),
            &usage("template", 1),
            DeadLetterReason::DeliveryLimit,
            "limit",
        )
        .unwrap();
    varied_letters(fx, 400, 7);
    // None stored yet: the grouping fingerprints them as it reads.
    let operator = Operator::new(&store);
    for filter in filters() {
        let groups = operator.failure_groups(&filter).unwrap();
        assert_eq!(shown(&groups), recomputed(&operator, &filter), "{filter:?}");
    }
    drop(operator);
    drop(store);
    // Backfilled: counted in SQL.
    let store = fx.open(fx.builder());
    assert!(stored(fx).iter().all(|l| l.failure_group.is_some()));
    check_against_recomputation(&store, true);
    // Stored and not stored together (an older binary wrote some since).
    varied_letters(fx, 150, 11);
    check_against_recomputation(&store, false);
    // A long error's sample is cut at SAMPLE_ERROR_CHARS characters.
    let groups = Operator::new(&store)
        .failure_groups(&DeadLetterFilter::default())
        .unwrap();
    assert!(groups.iter().any(|g| g
        .sample_error
        .as_ref()
        .is_some_and(|e| e.chars().count() == SAMPLE_ERROR_CHARS)));
}

/// PostgreSQL reads a failure group's letters through its index: on 20,000 letters of
/// 50 groups, analysed, the plan of the list's statement (the same filter, order and
/// limit `list_dead_letters` runs, written out) names
/// `inbox_dead_letters_failure_group`, with sequential scans left enabled.
#[test]
fn postgres_filters_a_failure_group_through_its_index() {
    let Some(fx) = inbox_test_support::PgFixture::new() else {
        return;
    };
    let _store = fx.open(fx.builder());
    fx.execute(
        "INSERT INTO inbox_dead_letters (consumer_group, message_key, message_type, payload, \
         headers, attempts, reason, last_error, dead_lettered_at, failure_group) \
         SELECT 'billing.daily-usage', 'k-' || i, 'usage.recorded', '\\x00'::bytea, '{}', 1, \
         'max_attempts', 'row ' || i, now() - i * interval '1 second', \
         lpad(to_hex(i % 50), 16, '0') FROM generate_series(1, 20000) AS i; \
         ANALYZE inbox_dead_letters",
    );
    #[derive(QueryableByName)]
    struct Line {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        line: String,
    }
    let plan: Vec<Line> = diesel::sql_query(
        "EXPLAIN SELECT id FROM inbox_dead_letters WHERE failure_group = '0000000000000007' \
         AND discarded_at IS NULL ORDER BY dead_lettered_at DESC, id DESC LIMIT 20 OFFSET 40",
    )
    .load(&mut fx.connect())
    .unwrap();
    let plan: Vec<String> = plan.into_iter().map(|l| l.line).collect();
    assert!(
        plan.iter()
            .any(|l| l.contains("inbox_dead_letters_failure_group")),
        "{plan:#?}"
    );
}

/// Each object the operator's bounded reads stand on is checked at startup: without
/// it `verify_schema` refuses the store, naming what it expected.
fn verify_schema_refuses_a_store_without_the_operator_reads_objects<F: Fixture>(fx: &F)
where
    F::Conn: RawLetters,
{
    use inbox_diesel::{Error, SchemaPart, SchemaProblem};
    let sqlite = !std::any::type_name::<F::Conn>().contains("Pg");
    let done_by_group = if sqlite {
        "CREATE INDEX inbox_claims_done_by_group ON inbox_claims (consumer_group, status, updated_at)"
    } else {
        "CREATE INDEX inbox_claims_done_by_group ON inbox_claims (consumer_group, updated_at) WHERE status = 'done'"
    };
    let cases: [(&str, &str, SchemaProblem, &str); 5] = [
        (
            "DROP INDEX inbox_dead_letters_failure_group",
            "CREATE INDEX inbox_dead_letters_failure_group ON inbox_dead_letters (failure_group, dead_lettered_at, id)",
            SchemaProblem::MissingIndex,
            "inbox_dead_letters_failure_group",
        ),
        (
            "DROP INDEX inbox_dead_letters_by_group",
            "CREATE INDEX inbox_dead_letters_by_group ON inbox_dead_letters (consumer_group, dead_lettered_at)",
            SchemaProblem::MissingIndex,
            "inbox_dead_letters_by_group",
        ),
        (
            "DROP INDEX inbox_claims_done_by_group",
            done_by_group,
            SchemaProblem::MissingIndex,
            "inbox_claims_done_by_group",
        ),
        (
            "DROP INDEX inbox_rebuild_reports_recent",
            "CREATE INDEX inbox_rebuild_reports_recent ON inbox_rebuild_reports (projection, id)",
            SchemaProblem::MissingIndex,
            "inbox_rebuild_reports_recent",
        ),
        (
            "DROP INDEX inbox_dead_letters_failure_group; \
             ALTER TABLE inbox_dead_letters DROP COLUMN failure_group",
            "ALTER TABLE inbox_dead_letters ADD COLUMN failure_group TEXT; \
             CREATE INDEX inbox_dead_letters_failure_group ON inbox_dead_letters (failure_group, dead_lettered_at, id)",
            SchemaProblem::MissingColumn,
            "failure_group",
        ),
    ];
    let store = fx.open(fx.builder());
    store.verify_schema().unwrap();
    for (break_it, repair, problem, named) in cases {
        fx.execute(break_it);
        match store.verify_schema() {
            Err(
                err @ Error::SchemaMismatch {
                    part: SchemaPart::Operator,
                    ..
                },
            ) => {
                let Error::SchemaMismatch { problem: found, .. } = &err else {
                    unreachable!()
                };
                assert_eq!(*found, problem, "{err}");
                assert!(err.to_string().contains(named), "{err}");
            }
            other => panic!("{break_it}: {other:?}"),
        }
        fx.execute(repair);
        store.verify_schema().unwrap();
    }
    // An index on the columns under another name serves as well.
    fx.execute(
        "DROP INDEX inbox_dead_letters_by_group; \
         CREATE INDEX letters_per_group ON inbox_dead_letters (consumer_group, dead_lettered_at, id)",
    );
    store.verify_schema().unwrap();
}

/// Two stores built at once on letters without a fingerprint (PostgreSQL: the second
/// waits for the first's migration lock; SQLite: their batches interleave, each in
/// its own write transaction): both start, and every letter ends with its own
/// fingerprint, none rewritten.
fn two_stores_built_at_once_backfill_every_letter_once<F: Fixture + Sync>(fx: &F)
where
    F::Conn: RawLetters,
{
    let store = fx.open(fx.builder());
    store
        .dead_letter(
            &group(GROUP),
            &usage("first", 1),
            DeadLetterReason::DeliveryLimit,
            "limit",
        )
        .unwrap();
    drop(store);
    for _ in 0..12 {
        copies_without_fingerprint(fx, 100, "order 9 of user 3 failed");
    }
    fx.execute("UPDATE inbox_dead_letters SET failure_group = 'ffffffffffffffff' WHERE message_key = 'first'");
    let barrier = std::sync::Barrier::new(2);
    std::thread::scope(|scope| {
        let builds: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    fx.builder().build().map(drop)
                })
            })
            .collect();
        for build in builds {
            build.join().unwrap().unwrap();
        }
    });
    let letters = stored(fx);
    assert_eq!(letters.len(), 1201);
    for l in &letters[1..] {
        assert_eq!(
            l.failure_group.as_deref(),
            Some(failure_fingerprint(&l.reason, &l.message_type, l.last_error.as_deref()).as_str()),
            "{l:?}"
        );
    }
    assert_eq!(
        letters[0].failure_group.as_deref(),
        Some("ffffffffffffffff")
    );
}
