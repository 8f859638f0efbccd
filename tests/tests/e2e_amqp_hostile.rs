//! Hostile broker input: whatever another client publishes to the consumer's exchange
//! ends in the dead letters with a reason (or is processed, if it is a valid event),
//! the valid events published around it are applied exactly once, and the consumer
//! neither crashes nor stalls.
//!
//! Everything a client library can send is published with lapin. What it cannot send
//! (strings that are not UTF-8, tables nested thousands of levels deep) is written
//! frame by frame by [`inbox_test_support::amqp::raw`]; those cases break lapin's own
//! frame parser on the consumer's side (see `frames_*`), before any delivery reaches
//! the runtime:
//!
//! - `parse_short_string` decodes with `String::from_utf8`, so a `message_id`, `type`
//!   or header name that is not UTF-8 fails the frame parser, which fails the whole
//!   connection; the consumer reconnects cautiously (prefetch 1) until the poison has
//!   used up its delivery limits and is parked in `<group>:unreadable`. Each group's
//!   workers and each `:dlq` reader have a connection of their own, so those losses
//!   cost no other group and no other queue anything (the cross-group cases).
//! - `parse_field_table` / `parse_value` recurse once per nesting level with no bound,
//!   so a table nested a few thousand levels deep overflows the stack of lapin's I/O
//!   thread and aborts the process unless `RUST_MIN_STACK` is large enough (see
//!   `inbox_amqp::frame_parse_stack`). The standard library reads `RUST_MIN_STACK`
//!   once, so that case runs in a child process of this test binary started with it
//!   set ([`in_a_child_with_the_parse_stack`]); the example consumer's process test
//!   (`examples/tests/hostile_frames_process.rs`) covers a table as deep as a frame
//!   allows.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::NaiveDate;
use diesel::PgConnection;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, StatsSnapshot, Topology};
use inbox_core::{ConsumerGroup, RetryPolicy};
use inbox_diesel::{DeadLetter, Store};
use inbox_examples::usage::{DailyUsage, UsageDb, UsageRecorded, GROUP, MESSAGE_TYPE};
use inbox_test_support::amqp::{self, amqp_url, confirm_channel, raw, wait_for_confirms};
use inbox_test_support::ms;
use inbox_test_support::PgFixture;
use lapin::types::{AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString};
use lapin::BasicProperties;

const MAX_BODY: usize = 1 << 20;

/// One test's schema, broker names, store and consumer.
struct Setup {
    _db: PgFixture,
    url: String,
    topology: Topology,
    group: ConsumerGroup,
    store: Arc<Store<PgConnection>>,
}

impl Setup {
    async fn new() -> Option<Self> {
        let url = amqp_url()?;
        let db = PgFixture::new()?;
        let group = ConsumerGroup::new(GROUP).unwrap();
        let topology = amqp::test_topology(&amqp::unique_prefix("h"), &[50, 100, 200])
            .queue_expires(Duration::from_secs(300))
            .group(group.clone(), [MESSAGE_TYPE]);
        let builder = inbox_test_support::Fixture::builder(&db)
            .pool_size(4)
            .retry_ladder(topology.retry_ladder().clone())
            .handler(DailyUsage::new(RetryPolicy::default()));
        let store = tokio::task::spawn_blocking(move || {
            let store = builder.build().expect("store");
            store.connection().unwrap().create_daily_usage().unwrap();
            store
        })
        .await
        .unwrap();
        let conn = amqp::connect(&url).await;
        topology.declare(&conn).await.unwrap();
        let _ = conn.close(200, "declared".into()).await;
        Some(Self {
            _db: db,
            url,
            topology,
            group,
            store: Arc::new(store),
        })
    }

    fn consumer(&self) -> Consumer<Store<PgConnection>> {
        Consumer::new(
            self.url.clone(),
            Arc::clone(&self.store),
            self.topology.clone(),
        )
        .with_settings(
            ConsumerSettings::default()
                .workers(2)
                .prefetch(100)
                .batch(20, ms(5))
                .max_body_bytes(MAX_BODY)
                .backoff(ms(50), ms(500))
                .connection_name("hostile-input-test"),
        )
    }

    fn totals(&self) -> BTreeMap<(i64, NaiveDate), i64> {
        self.store.connection().unwrap().daily_totals().unwrap()
    }

    fn dead_letters(&self) -> Vec<DeadLetter> {
        self.store.dead_letters(&self.group).unwrap()
    }

    async fn cleanup(&self) {
        let conn = amqp::connect(&self.url).await;
        self.topology.delete(&conn).await.expect("delete topology");
        let _ = conn.close(200, "done".into()).await;
    }
}

fn day() -> NaiveDate {
    NaiveDate::from_ymd_opt(2026, 11, 30).unwrap()
}

fn event_body(user_id: i64, amount: i64) -> Vec<u8> {
    serde_json::to_vec(&UsageRecorded {
        user_id,
        day: day(),
        amount,
    })
    .unwrap()
}

/// Deterministic bytes that are neither JSON nor UTF-8.
fn random_bytes(n: usize, mut seed: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        })
        .collect()
}

/// How a case's dead letter is found.
#[derive(Clone, Debug)]
enum Ident {
    /// By its message key (the `message_id` was a valid key).
    Key(String),
    /// By its payload (an unreadable delivery is dead-lettered under a made-up key).
    Payload(Vec<u8>),
    /// By what is kept of a body over the limit: its first `CUT_PAYLOAD_PREFIX`
    /// bytes, its length and its SHA-256 (the body itself is never stored).
    Cut(Vec<u8>),
}

/// What must become of a case.
#[derive(Clone, Debug)]
enum Expect {
    /// Applied once: (user, amount).
    Applied(i64, i64),
    /// Dead-lettered with this reason, and the last error mentions `detail`.
    Dead {
        ident: Ident,
        reason: &'static str,
        detail: &'static str,
    },
}

struct Case {
    name: &'static str,
    properties: BasicProperties,
    routing_key: String,
    body: Vec<u8>,
    expect: Expect,
}

fn typed(id: &str) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(id.into())
        .with_type(MESSAGE_TYPE.into())
        .with_delivery_mode(2)
}

fn with_headers(props: BasicProperties, entries: Vec<(&str, AMQPValue)>) -> BasicProperties {
    let mut table = FieldTable::default();
    for (name, value) in entries {
        table.insert(name.into(), value);
    }
    props.with_headers(table)
}

fn long(s: &[u8]) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.to_vec()))
}

/// A table nested `depth` levels, with a scalar at the bottom.
fn nested(depth: usize) -> AMQPValue {
    let mut value = AMQPValue::LongInt(7);
    for _ in 0..depth {
        let mut table = FieldTable::default();
        table.insert("n".into(), value);
        value = AMQPValue::FieldTable(table);
    }
    value
}

/// Every field type AMQP 0-9-1 (RabbitMQ's dialect) has.
fn odd_field_types() -> Vec<(&'static str, AMQPValue)> {
    vec![
        ("a-bool", AMQPValue::Boolean(true)),
        ("a-byte", AMQPValue::ShortShortInt(-7)),
        ("an-unsigned-byte", AMQPValue::ShortShortUInt(250)),
        ("a-short", AMQPValue::ShortInt(-300)),
        ("a-long", AMQPValue::LongInt(-70_000)),
        ("a-long-long", AMQPValue::LongLongInt(i64::MIN)),
        // Finite: RabbitMQ 3.10 cannot parse a NaN or an infinity (its channel
        // crashes with INTERNAL_ERROR and closes the publisher's connection).
        ("a-float", AMQPValue::Float(-0.0)),
        ("a-double", AMQPValue::Double(f64::MAX)),
        (
            "a-decimal",
            AMQPValue::DecimalValue(DecimalValue {
                scale: 255,
                value: u32::MAX,
            }),
        ),
        ("a-timestamp", AMQPValue::Timestamp(u64::MAX)),
        (
            "a-byte-array",
            AMQPValue::ByteArray(ByteArray::from(vec![0u8, 0xff, 0xfe, 0])),
        ),
        ("a-void", AMQPValue::Void),
        (
            "an-array",
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::Void,
                AMQPValue::Boolean(false),
                nested(3),
                AMQPValue::FieldArray(FieldArray::from(vec![long(b"deep")])),
            ])),
        ),
        ("a-table", nested(5)),
        ("", long(b"a header with an empty name")),
    ]
}

/// The cases a client library can publish, each expecting what it must become.
fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut add = |name, properties, body: Vec<u8>, expect| {
        cases.push(Case {
            name,
            properties,
            routing_key: MESSAGE_TYPE.to_owned(),
            body,
            expect,
        })
    };
    let dead_key = |key: &str, reason, detail| Expect::Dead {
        ident: Ident::Key(key.to_owned()),
        reason,
        detail,
    };
    let dead_payload = |body: &[u8], reason, detail| Expect::Dead {
        ident: Ident::Payload(body.to_vec()),
        reason,
        detail,
    };

    // Bodies.
    add(
        "random bytes",
        typed("h-random"),
        random_bytes(512, 99),
        dead_key("h-random", "decode_error", "does not decode"),
    );
    add(
        "empty body",
        typed("h-empty"),
        Vec::new(),
        dead_key("h-empty", "decode_error", "does not decode"),
    );
    let mut huge = event_body(1, 1);
    huge.resize(MAX_BODY + 1, b' ');
    add(
        "a body one byte over the limit",
        typed("h-huge"),
        huge.clone(),
        Expect::Dead {
            ident: Ident::Cut(huge.clone()),
            reason: "malformed",
            detail: "exceeds the limit",
        },
    );
    let mut at_limit = event_body(3, 31);
    at_limit.resize(MAX_BODY, b' ');
    add(
        "a valid body exactly at the limit",
        typed("h-at-limit"),
        at_limit,
        Expect::Applied(3, 31),
    );
    add(
        "100k nested JSON arrays",
        typed("h-nested-json"),
        vec![b'['; 100_000],
        dead_key("h-nested-json", "decode_error", "does not decode"),
    );
    let mut deep_field = br#"{"user_id": 1, "day": "2026-11-30", "amount": "#.to_vec();
    deep_field.extend(std::iter::repeat_n(b'{', 50_000));
    add(
        "50k nested JSON objects in a field",
        typed("h-nested-field"),
        deep_field,
        dead_key("h-nested-field", "decode_error", "does not decode"),
    );
    for (id, body) in [
        (
            "h-amount-u64",
            &br#"{"user_id": 1, "day": "2026-11-30", "amount": 18446744073709551616}"#[..],
        ),
        (
            "h-amount-exp",
            br#"{"user_id": 1, "day": "2026-11-30", "amount": 1e400}"#,
        ),
        (
            "h-user-fraction",
            br#"{"user_id": 1.5, "day": "2026-11-30", "amount": 3}"#,
        ),
        (
            "h-user-i128",
            br#"{"user_id": -170141183460469231731687303715884105728, "day": "2026-11-30", "amount": 3}"#,
        ),
        (
            "h-day-feb-30",
            br#"{"user_id": 1, "day": "2026-02-30", "amount": 3}"#,
        ),
        (
            "h-day-year-huge",
            br#"{"user_id": 1, "day": "99999999-01-01", "amount": 3}"#,
        ),
        (
            "h-not-utf8-in-string",
            b"{\"user_id\": 1, \"day\": \"2026-11-\xff\xfe\", \"amount\": 3}",
        ),
    ] {
        add(
            "numbers and dates out of range",
            typed(id),
            body.to_vec(),
            dead_key(id, "decode_error", "does not decode"),
        );
    }
    add(
        "a negative amount",
        typed("h-negative"),
        event_body(1, -5),
        // Outside the contract's amount range: refused when decoded.
        dead_key("h-negative", "decode_error", "amount must be 1 to"),
    );

    // Keys and types.
    let nul_id_body = br#"{"case": "a NUL in message_id"}"#.to_vec();
    add(
        "a NUL in message_id",
        typed("h-\0-nul"),
        nul_id_body.clone(),
        dead_payload(&nul_id_body, "malformed", "NUL"),
    );
    let empty_id_body = br#"{"case": "an empty message_id"}"#.to_vec();
    add(
        "an empty message_id",
        typed(""),
        empty_id_body.clone(),
        dead_payload(&empty_id_body, "malformed", "must not be empty"),
    );
    let id_255 = "k".repeat(255);
    add(
        "a 255-byte message_id",
        typed(&id_255),
        event_body(4, 255),
        Expect::Applied(4, 255),
    );
    // 127 two-byte characters and one more byte: 255 bytes, 128 characters.
    let id_255_multibyte = format!("{}x", "é".repeat(127));
    add(
        "a 255-byte message_id of two-byte characters",
        typed(&id_255_multibyte),
        event_body(4, 254),
        Expect::Applied(4, 254),
    );
    // A 256-byte message_id cannot be put on the wire: a short string's length is
    // one byte (lapin's encoder asserts it in debug builds and truncates the length
    // in release ones, desynchronising the frame).
    add(
        "a NUL in the type",
        BasicProperties::default()
            .with_message_id("h-type-nul".into())
            .with_type("usage.\0recorded".into()),
        event_body(1, 1),
        dead_key("h-type-nul", "malformed", "type contains a NUL byte"),
    );
    add(
        "a 255-byte type",
        BasicProperties::default()
            .with_message_id("h-type-255".into())
            .with_type("t".repeat(255).as_str().into()),
        event_body(1, 1),
        dead_key("h-type-255", "no_handler", "no handler"),
    );
    add(
        "no type property: the routing key is the type",
        BasicProperties::default().with_message_id("h-untyped".into()),
        event_body(5, 5),
        Expect::Applied(5, 5),
    );

    // Headers.
    add(
        "every odd field type in the headers",
        with_headers(typed("h-odd-types"), odd_field_types()),
        event_body(6, 6),
        Expect::Applied(6, 6),
    );
    add(
        "a NUL in a header name and in a header value",
        with_headers(
            typed("h-header-nul"),
            vec![("ten\0ant", long(b"acme")), ("note", long(b"\0\0\0"))],
        ),
        event_body(7, 7),
        Expect::Applied(7, 7),
    );
    // The tenant is stored beside the claim, in a text column that cannot hold NUL.
    add(
        "a NUL in the tenant",
        with_headers(typed("h-tenant-nul"), vec![("tenant", long(b"ac\0me"))]),
        event_body(1, 1),
        dead_key("h-tenant-nul", "malformed", "tenant contains a NUL byte"),
    );
    let mut not_utf8: Vec<u8> = random_bytes(4096, 7)
        .into_iter()
        .map(|b| if b == 0 { 0xff } else { b })
        .collect();
    not_utf8[0] = 0xff;
    add(
        "a tenant that is not UTF-8, 4 KiB long",
        with_headers(typed("h-tenant-bytes"), vec![("tenant", long(&not_utf8))]),
        event_body(8, 8),
        Expect::Applied(8, 8),
    );
    add(
        "tenant and occurred_at of the wrong types",
        with_headers(
            typed("h-wrong-types"),
            vec![
                ("tenant", nested(2)),
                ("occurred_at", long(b"yesterday, around noon")),
                ("x-delivery-count", long(b"-1")),
            ],
        ),
        event_body(9, 9),
        Expect::Applied(9, 9),
    );
    add(
        "x-delivery-count out of range",
        with_headers(
            typed("h-count-range"),
            vec![("x-delivery-count", AMQPValue::LongLongInt(i64::MIN))],
        ),
        event_body(10, 10),
        Expect::Applied(10, 10),
    );
    add(
        "a forged x-death on an untyped message",
        with_headers(
            BasicProperties::default().with_message_id("h-forged-death".into()),
            vec![
                ("x-first-death-queue", AMQPValue::Boolean(true)),
                (
                    "x-death",
                    AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Void, nested(4)])),
                ),
            ],
        ),
        event_body(11, 11),
        Expect::Applied(11, 11),
    );
    cases
}

/// Publishes each case between two valid neighbours, through lapin; returns the
/// neighbours' totals.
async fn publish_between_neighbours(
    setup: &Setup,
    cases: &[Case],
    first_neighbour: usize,
) -> (BTreeMap<(i64, NaiveDate), i64>, usize) {
    let conn = amqp::connect(&setup.url).await;
    let channel = confirm_channel(&conn).await;
    let exchange = setup.topology.exchange();
    let mut expected = BTreeMap::new();
    let mut n = first_neighbour;
    let mut neighbour = |expected: &mut BTreeMap<_, i64>| {
        n += 1;
        let user = 100 + (n % 7) as i64;
        *expected.entry((user, day())).or_default() += n as i64;
        (format!("neighbour-{n}"), event_body(user, n as i64))
    };
    for case in cases {
        for at in [0, 1] {
            if at == 1 {
                channel
                    .basic_publish(
                        exchange.as_str().into(),
                        case.routing_key.as_str().into(),
                        lapin::options::BasicPublishOptions::default(),
                        &case.body,
                        case.properties.clone(),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("publish {}: {e}", case.name));
            }
            let (id, body) = neighbour(&mut expected);
            channel
                .basic_publish(
                    exchange.as_str().into(),
                    MESSAGE_TYPE.into(),
                    lapin::options::BasicPublishOptions::default(),
                    &body,
                    typed(&id),
                )
                .await
                .unwrap();
        }
    }
    wait_for_confirms(&channel).await;
    let _ = conn.close(200, "done".into()).await;
    (expected, n - first_neighbour)
}

fn add_applied(expected: &mut BTreeMap<(i64, NaiveDate), i64>, cases: &[Case]) {
    for case in cases {
        if let Expect::Applied(user, amount) = case.expect {
            *expected.entry((user, day())).or_default() += amount;
        }
    }
}

/// Runs the consumer until `done` holds (or `limit`), then stops it; the consumer
/// must end cleanly.
async fn run_until(
    setup: &Setup,
    limit: Duration,
    done: impl Fn(&Setup, &StatsSnapshot) -> bool,
) -> (bool, StatsSnapshot) {
    let consumer = setup.consumer();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    let deadline = Instant::now() + limit;
    let mut finished = false;
    while Instant::now() < deadline && !running.is_finished() {
        let snapshot = stats.snapshot();
        if done(setup, &snapshot) {
            finished = true;
            break;
        }
        tokio::time::sleep(ms(100)).await;
    }
    shutdown.cancel();
    running
        .await
        .unwrap()
        .expect("the consumer ends cleanly, it does not crash");
    (finished, stats.snapshot())
}

fn find<'a>(dead: &'a [DeadLetter], ident: &Ident) -> Vec<&'a DeadLetter> {
    dead.iter()
        .filter(|d| match ident {
            Ident::Key(key) => d.key == *key,
            Ident::Payload(payload) => d.payload == *payload,
            Ident::Cut(body) => {
                d.payload == body[..inbox_core::CUT_PAYLOAD_PREFIX]
                    && d.payload_cut
                        == Some(inbox_core::PayloadCut {
                            length: body.len() as u64,
                            sha256: inbox_core::payload_digest(body),
                        })
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_keys_types_and_headers_end_dead_lettered_and_cost_their_neighbours_nothing()
{
    let Some(setup) = Setup::new().await else {
        return;
    };
    let cases = cases();
    let (mut expected, neighbours) = publish_between_neighbours(&setup, &cases, 0).await;
    add_applied(&mut expected, &cases);
    let dead_expected = cases
        .iter()
        .filter(|c| matches!(c.expect, Expect::Dead { .. }))
        .count();
    let total = cases.len() + neighbours;

    let (finished, stats) = run_until(&setup, Duration::from_secs(90), |setup, s| {
        s.received as usize >= total
            && setup.totals() == expected
            && setup.dead_letters().len() >= dead_expected
    })
    .await;
    let found = setup.totals();
    let dead = setup.dead_letters();
    let mut problems = Vec::new();
    if !finished {
        problems.push(format!("not finished in time: {stats:?}"));
    }
    for diff in inbox_examples::usage::diff_totals(&expected, &found) {
        problems.push(diff);
    }
    for case in &cases {
        if let Expect::Dead {
            ident,
            reason,
            detail,
        } = &case.expect
        {
            let letters = find(&dead, ident);
            match letters.as_slice() {
                [one]
                    if one.reason.as_str() == *reason
                        && one.last_error.as_deref().unwrap_or("").contains(detail) => {}
                other => problems.push(format!(
                    "{}: expected one dead letter ({reason}, {detail:?}), found {:?}",
                    case.name,
                    other
                        .iter()
                        .map(|d| (&d.key, &d.reason, &d.last_error))
                        .collect::<Vec<_>>()
                )),
            }
        }
    }
    if dead.len() != dead_expected {
        problems.push(format!(
            "expected {dead_expected} dead letters, found {}: {:?}",
            dead.len(),
            dead.iter()
                .map(|d| (&d.key, &d.reason, &d.last_error))
                .collect::<Vec<_>>()
        ));
    }
    if stats.reconnects != 0 {
        problems.push(format!(
            "no input may cost the connection: {} reconnects",
            stats.reconnects
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // Not stalled: a valid event published now is applied at once.
    let props = raw::Properties {
        message_id: Some(b"after-the-storm".to_vec()),
        message_type: Some(MESSAGE_TYPE.as_bytes().to_vec()),
        headers: None,
    };
    raw::publish(
        &setup.url,
        &setup.topology.exchange(),
        MESSAGE_TYPE,
        &props,
        &event_body(12, 12),
    )
    .await
    .unwrap();
    *expected.entry((12, day())).or_default() += 12;
    let (finished, _) = run_until(&setup, Duration::from_secs(30), |setup, s| {
        s.processed >= 1 && setup.totals() == expected
    })
    .await;
    assert!(finished, "the consumer stalled after the hostile input");
    setup.cleanup().await;
}

/// Set in the child process [`in_a_child_with_the_parse_stack`] starts.
const CHILD_MARKER: &str = "INBOX_HOSTILE_FRAMES_CHILD";

/// Whether this process is the child [`in_a_child_with_the_parse_stack`] started.
fn in_the_child() -> bool {
    std::env::var_os(CHILD_MARKER).is_some()
}

/// Runs the test `name` of this test binary alone in a child process whose threads
/// (lapin's I/O thread among them) get `inbox_amqp::frame_parse_stack()` bytes of
/// stack, and fails unless the child passes; its output is echoed.
fn in_a_child_with_the_parse_stack(name: &str) {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_MARKER, "1")
        .env(
            "RUST_MIN_STACK",
            inbox_amqp::frame_parse_stack().to_string(),
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "{name} failed in its child ({}): {stdout}",
        out.status
    );
    // Proof the child ran the test rather than filtering it out.
    assert!(
        stdout.contains("1 passed"),
        "{name} did not run in its child: {stdout}"
    );
}

/// Publishes `properties` raw between two valid neighbours, then runs the consumer:
/// the neighbours must be applied once, delivered at most twice each (the delivery
/// in flight when the poison first broke the connection), and the poison end in the
/// dead letters or, if no reader can parse it, in the group's parking queue
/// `<group>:unreadable`.
async fn raw_poison_between_neighbours(name: &str, properties: raw::Properties, limit: Duration) {
    let Some(setup) = Setup::new().await else {
        return;
    };
    let exchange = setup.topology.exchange();
    let mut expected = BTreeMap::new();
    for (i, at) in [(1i64, false), (2, true), (3, false)] {
        if at {
            let poison = format!(r#"{{"case": "{name}"}}"#);
            raw::publish(
                &setup.url,
                &exchange,
                MESSAGE_TYPE,
                &properties,
                poison.as_bytes(),
            )
            .await
            .unwrap_or_else(|e| panic!("the broker refused {name}: {e}"));
        }
        let id = format!("raw-neighbour-{i}");
        let props = raw::Properties {
            message_id: Some(id.into_bytes()),
            message_type: Some(MESSAGE_TYPE.as_bytes().to_vec()),
            headers: None,
        };
        raw::publish(
            &setup.url,
            &exchange,
            MESSAGE_TYPE,
            &props,
            &event_body(200, i),
        )
        .await
        .unwrap();
        *expected.entry((200, day())).or_default() += i;
    }
    let consumer = setup.consumer();
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    let conn = amqp::connect(&setup.url).await;
    let unreadable = setup.topology.unreadable(&setup.group);
    let started = Instant::now();
    let mut finished = false;
    while started.elapsed() < limit && !running.is_finished() {
        let parked = amqp::queue_depth(&conn, &unreadable).await;
        if setup.totals() == expected && (parked == 1 || !setup.dead_letters().is_empty()) {
            finished = true;
            break;
        }
        tokio::time::sleep(ms(100)).await;
    }
    let took = started.elapsed();
    shutdown.cancel();
    running
        .await
        .unwrap()
        .expect("the consumer ends cleanly, it does not crash");
    let stats = stats.snapshot();
    let dead = setup.dead_letters();
    let found = setup.totals();
    let depths = (
        amqp::queue_depth(&conn, &setup.topology.queue(&setup.group)).await,
        amqp::queue_depth(&conn, &setup.topology.dlq(&setup.group)).await,
        amqp::queue_depth(&conn, &unreadable).await,
    );
    let _ = conn.close(200, "done".into()).await;
    setup.cleanup().await;
    eprintln!("{name}: settled in {took:?}; (queue, dlq, unreadable) {depths:?}; {stats:?}");
    let dead_summary = dead
        .iter()
        .map(|d| (&d.key, &d.reason, &d.last_error))
        .collect::<Vec<_>>();
    assert!(
        finished,
        "{name}: neighbours applied {found:?} of {expected:?}; (queue, dlq, unreadable) ready \
         {depths:?}; dead letters {dead_summary:?}; {stats:?}"
    );
    assert_eq!(found, expected, "{name}: each neighbour applied once");
    // The poison is parked or recorded, once; no neighbour is a dead letter.
    let parked = depths.2 as usize;
    assert_eq!(
        parked + dead.len(),
        1,
        "{name}: {depths:?}, {dead_summary:?}"
    );
    assert!(
        dead.iter().all(|d| !d.key.starts_with("raw-neighbour-")),
        "{name}: a neighbour was dead-lettered: {dead_summary:?}"
    );
    // The runtime received each neighbour at most twice: the poison cost them at most
    // the one delivery in flight when it first broke the connection.
    assert!(
        stats.received <= 4,
        "{name}: the neighbours were delivered {} times: {stats:?}",
        stats.received
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_nested_a_hundred_levels_deep_is_read() {
    // Within what lapin's recursive parser survives: the frame-level path works.
    let Some(setup) = Setup::new().await else {
        return;
    };
    let headers = raw::table(&[(b"deep", raw::nested_table_value(100))]);
    let props = raw::Properties {
        message_id: Some(b"raw-deep-100".to_vec()),
        message_type: Some(MESSAGE_TYPE.as_bytes().to_vec()),
        headers: Some(headers),
    };
    raw::publish(
        &setup.url,
        &setup.topology.exchange(),
        MESSAGE_TYPE,
        &props,
        &event_body(300, 3),
    )
    .await
    .unwrap();
    let (finished, stats) =
        run_until(&setup, Duration::from_secs(30), |_, s| s.processed >= 1).await;
    assert!(finished, "{stats:?}");
    assert_eq!(setup.totals(), BTreeMap::from([((300, day()), 3)]));
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_a_message_id_that_is_not_utf8() {
    let props = raw::Properties {
        message_id: Some(b"bad-\xff\xfe-id".to_vec()),
        message_type: Some(MESSAGE_TYPE.as_bytes().to_vec()),
        headers: None,
    };
    raw_poison_between_neighbours(
        "a message_id that is not UTF-8",
        props,
        Duration::from_secs(60),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_a_type_that_is_not_utf8() {
    let props = raw::Properties {
        message_id: Some(b"raw-bad-type".to_vec()),
        message_type: Some(b"usage.\xc3\x28".to_vec()),
        headers: None,
    };
    raw_poison_between_neighbours("a type that is not UTF-8", props, Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_a_header_name_that_is_not_utf8() {
    let props = raw::Properties {
        message_id: Some(b"raw-bad-header".to_vec()),
        message_type: Some(MESSAGE_TYPE.as_bytes().to_vec()),
        headers: Some(raw::table(&[(b"ten\xffant", raw::long_value(b"acme"))])),
    };
    raw_poison_between_neighbours(
        "a header name that is not UTF-8",
        props,
        Duration::from_secs(60),
    )
    .await;
}

#[test]
fn frames_a_table_nested_five_thousand_levels_deep() {
    const NAME: &str = "frames_a_table_nested_five_thousand_levels_deep";
    if !in_the_child() {
        in_a_child_with_the_parse_stack(NAME);
        return;
    }
    let props = raw::Properties {
        message_id: Some(b"raw-deep-5000".to_vec()),
        message_type: Some(MESSAGE_TYPE.as_bytes().to_vec()),
        headers: Some(raw::table(&[(b"deep", raw::nested_table_value(5_000))])),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(raw_poison_between_neighbours(
        "a table nested 5,000 levels",
        props,
        Duration::from_secs(60),
    ));
}

/// The group whose queues a poison reaches in the cross-group cases.
const POISONED: &str = "hostile.poisoned";
/// The group (or queue) a steady stream of valid messages goes to meanwhile.
const STREAMED: &str = "hostile.streamed";

/// What the consumer saw of one delivery, as its store was handed it.
#[derive(Clone, Debug)]
struct Seen {
    group: String,
    key: String,
    /// Through the dead-letter reader (`:dlq`) rather than a worker.
    dead_letter: bool,
    redelivered: bool,
    delivery_count: Option<u32>,
}

/// A store for two groups that applies everything and remembers each delivery it was
/// handed; a batch takes 20 ms and a dead letter 5 ms, so a busy stream has
/// deliveries in flight (received, not yet acked) when a connection is lost.
#[derive(Default)]
struct Recording {
    seen: std::sync::Mutex<Vec<Seen>>,
    halts: std::sync::Mutex<Vec<inbox_core::ClaimInvariantViolated>>,
}

impl Recording {
    fn record(&self, group: &ConsumerGroup, e: &inbox_core::Envelope, dead_letter: bool) {
        self.seen.lock().unwrap().push(Seen {
            group: group.to_string(),
            key: e.message_key.as_str().to_owned(),
            dead_letter,
            redelivered: e.redelivered,
            delivery_count: e.delivery_count,
        });
    }

    fn of_stream(&self) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|s| s.key.starts_with("stream-"))
            .cloned()
            .collect()
    }
}

impl inbox_core::InboxStore for Recording {
    fn process_batch(
        &self,
        group: &ConsumerGroup,
        batch: &[inbox_core::Envelope],
    ) -> inbox_core::Result<Vec<inbox_core::Decision>> {
        std::thread::sleep(ms(20));
        for e in batch {
            self.record(group, e, false);
        }
        Ok(vec![inbox_core::Decision::Processed; batch.len()])
    }

    fn routes(&self) -> Vec<(ConsumerGroup, String)> {
        [POISONED, STREAMED]
            .map(|g| (ConsumerGroup::new(g).unwrap(), format!("{g}.event")))
            .into()
    }

    fn dead_letter(
        &self,
        group: &ConsumerGroup,
        envelope: &inbox_core::Envelope,
        _: inbox_core::DeadLetterReason,
        _: &str,
    ) -> inbox_core::Result<inbox_core::DeadLetterOutcome> {
        std::thread::sleep(ms(5));
        self.record(group, envelope, true);
        Ok(inbox_core::DeadLetterOutcome::Recorded)
    }
}

/// It never stops a group; halts are kept in memory like any store's.
impl inbox_core::GroupHalts for Recording {
    fn record_halt(&self, cause: &inbox_core::ClaimInvariantViolated) -> inbox_core::Result<()> {
        self.halts.lock().unwrap().push(cause.clone());
        Ok(())
    }

    fn halted_groups(&self) -> inbox_core::Result<Vec<inbox_core::ClaimInvariantViolated>> {
        Ok(self.halts.lock().unwrap().clone())
    }
}

/// Where a cross-group case puts its poison or its stream.
#[derive(Clone, Copy, Debug)]
enum Target {
    /// The group's queue, through the exchange.
    Queue(&'static str),
    /// The group's `:dlq`, straight through the default exchange.
    Dlq(&'static str),
}

impl Target {
    /// (exchange, routing key) that reach it.
    fn address(self, topology: &Topology) -> (String, String) {
        match self {
            Target::Queue(group) => (topology.exchange(), format!("{group}.event")),
            Target::Dlq(group) => (
                String::new(),
                topology.dlq(&ConsumerGroup::new(group).unwrap()),
            ),
        }
    }
}

/// A poison whose header name is not UTF-8 (it fails lapin's parse of the frame and
/// with it the connection) goes `poison`, while a steady stream of valid messages
/// goes `stream` until the poison has used up every try and is parked in
/// `hostile.poisoned:unreadable`: every stream message must reach the store exactly
/// once, never redelivered (the poison's connection losses cost it nothing).
async fn a_poison_costs_a_busy_stream_nothing(poison: Target, stream: Target) {
    let Some(url) = amqp_url() else { return };
    let store = Arc::new(Recording::default());
    let topology = amqp::test_topology(&amqp::unique_prefix("x"), &[50, 100, 200])
        .queue_expires(Duration::from_secs(300))
        .delivery_limit(5)
        .with_routes(inbox_core::InboxStore::routes(&*store));
    let conn = amqp::connect(&url).await;
    topology.declare(&conn).await.unwrap();
    let consumer = Consumer::new(url.clone(), Arc::clone(&store), topology.clone()).with_settings(
        ConsumerSettings::default()
            .workers(2)
            .prefetch(20)
            .batch(10, ms(5))
            .backoff(ms(50), ms(500))
            .connection_name("hostile-groups-test"),
    );
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));

    let props = raw::Properties {
        message_id: Some(b"raw-cross-group-poison".to_vec()),
        message_type: Some(format!("{POISONED}.event").into_bytes()),
        headers: Some(raw::table(&[(b"ten\xffant", raw::long_value(b"acme"))])),
    };
    let (exchange, key) = poison.address(&topology);
    raw::publish(&url, &exchange, &key, &props, br#"{"case": "poison"}"#)
        .await
        .unwrap();

    let channel = confirm_channel(&conn).await;
    let (exchange, key) = stream.address(&topology);
    let stream_type = match stream {
        Target::Queue(g) | Target::Dlq(g) => format!("{g}.event"),
    };
    let unreadable = topology.unreadable(&ConsumerGroup::new(POISONED).unwrap());
    let started = Instant::now();
    let mut published = 0usize;
    let mut parked = false;
    // At least 100, and on until the poison is parked (or a minute has passed).
    while (published < 100 || !parked) && started.elapsed() < Duration::from_secs(60) {
        for _ in 0..10 {
            published += 1;
            let id = format!("stream-{published}");
            channel
                .basic_publish(
                    exchange.as_str().into(),
                    key.as_str().into(),
                    lapin::options::BasicPublishOptions::default(),
                    b"{}",
                    BasicProperties::default()
                        .with_message_id(id.as_str().into())
                        .with_type(stream_type.as_str().into())
                        .with_delivery_mode(2),
                )
                .await
                .unwrap();
        }
        wait_for_confirms(&channel).await;
        parked = amqp::queue_depth(&conn, &unreadable).await == 1;
        tokio::time::sleep(ms(100)).await;
    }
    let all_seen = amqp::eventually(Duration::from_secs(30), || {
        store.of_stream().len() >= published
    })
    .await;
    let took = started.elapsed();
    shutdown.cancel();
    running
        .await
        .unwrap()
        .expect("the consumer ends cleanly, it does not crash");
    let stats = stats.snapshot();
    topology.delete(&conn).await.unwrap();
    let _ = conn.close(200, "done".into()).await;

    let seen = store.of_stream();
    eprintln!(
        "poison {poison:?}, stream {stream:?}: {published} published, {} seen in {took:?}; {stats:?}",
        seen.len()
    );
    assert!(parked, "the poison was never parked: {stats:?}");
    assert!(all_seen, "{} of {published} seen: {stats:?}", seen.len());
    let mut times: BTreeMap<&str, usize> = BTreeMap::new();
    for s in &seen {
        *times.entry(s.key.as_str()).or_default() += 1;
    }
    let again: Vec<_> = times.iter().filter(|(_, n)| **n > 1).collect();
    let redelivered: Vec<_> = seen
        .iter()
        .filter(|s| s.redelivered || s.delivery_count.is_some())
        .map(|s| (&s.key, s.redelivered, s.delivery_count))
        .collect();
    assert!(
        again.is_empty() && redelivered.is_empty(),
        "the poison cost the stream: {} of {published} seen more than once {again:?}; \
         redelivered {redelivered:?}",
        again.len()
    );
    assert_eq!(times.len(), published, "every stream message seen once");
    let (group, through_dlq) = match stream {
        Target::Queue(g) => (g, false),
        Target::Dlq(g) => (g, true),
    };
    assert!(
        seen.iter()
            .all(|s| s.group == group && s.dead_letter == through_dlq),
        "{seen:?}"
    );
}

/// Each group's workers have a connection of their own: a poison in one group's
/// queue never costs another group's deliveries a redelivery (nor, in the end, a
/// dead letter at its delivery limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_a_poison_in_one_group_costs_another_group_nothing() {
    a_poison_costs_a_busy_stream_nothing(Target::Queue(POISONED), Target::Queue(STREAMED)).await;
}

/// The `:dlq` reader has a connection of its own: a poison in the group's `:dlq`
/// (tried there 50 times) never costs the group's own busy workers a redelivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_a_poison_in_the_dlq_costs_its_groups_workers_nothing() {
    a_poison_costs_a_busy_stream_nothing(Target::Dlq(POISONED), Target::Queue(POISONED)).await;
}

/// Each group's `:dlq` reader has a connection of its own: a poison in one group's
/// `:dlq` never costs another group's dead letters a redelivery (which, 50 times
/// over, would park a readable dead letter in `:unreadable`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_a_poison_in_one_dlq_costs_another_groups_dlq_nothing() {
    a_poison_costs_a_busy_stream_nothing(Target::Dlq(POISONED), Target::Dlq(STREAMED)).await;
}
