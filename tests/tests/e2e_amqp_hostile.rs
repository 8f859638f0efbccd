//! Hostile broker input: whatever another client publishes to the consumer's exchange
//! ends in the dead letters with a reason (or is processed, if it is a valid event),
//! the valid events published around it are applied exactly once, and the consumer
//! neither crashes nor stalls.
//!
//! Everything a client library can send is published with lapin. What it cannot send
//! (strings that are not UTF-8, tables nested thousands of levels deep) is written
//! frame by frame by [`inbox_test_support::amqp::raw`]; those cases break lapin's own
//! frame parser on the consumer's side and run only with `INBOX_HOSTILE_FRAMES=1`
//! (see [`frames_gate`]).

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
        dead_payload(&huge, "malformed", "exceeds the limit"),
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
                    if one.reason == *reason
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

/// The cases written frame by frame break lapin 4.12 / amq-protocol-types 10.6 on the
/// consumer's side, before any delivery reaches the runtime:
///
/// - `parse_short_string` decodes with `String::from_utf8`, so a `message_id`, `type`
///   or header name that is not UTF-8 fails the frame parser, which fails the whole
///   connection; the consumer reconnects, is sent the same message first, and fails
///   again.
/// - `parse_field_table` / `parse_value` recurse once per nesting level with no bound,
///   so a table nested a few thousand levels deep overflows the stack of lapin's I/O
///   thread and aborts the process.
///
/// They run with `INBOX_HOSTILE_FRAMES=1` only, because today they fail (the three
/// UTF-8 cases, after their 60 s: some 600 reconnects, no delivery ever reaches the
/// runtime, the neighbour published before the poison is dead-lettered by the broker
/// as `delivery_limit` after 21 deliveries, unapplied, and the poison, once in the
/// `:dlq`, breaks the dead-letter reader's connection the same way) or abort the test
/// process (the nested table: "thread 'lapin-io-loop' has overflowed its stack",
/// SIGABRT within a second). Ungate them once lapin's parser is bounded or the
/// runtime guards against it.
fn frames_gate(case: &str) -> bool {
    let on = std::env::var("INBOX_HOSTILE_FRAMES").is_ok_and(|v| v == "1");
    if !on {
        eprintln!("skipping {case}: set INBOX_HOSTILE_FRAMES=1 (it breaks lapin's frame parser)");
    }
    on
}

/// Publishes `properties` raw between two valid neighbours, then runs the consumer:
/// the neighbours must be applied once and the poison end in the dead letters.
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
    let (finished, stats) = run_until(&setup, limit, |setup, _| {
        setup.totals() == expected && !setup.dead_letters().is_empty()
    })
    .await;
    let dead = setup.dead_letters();
    let found = setup.totals();
    let conn = amqp::connect(&setup.url).await;
    let depths = (
        amqp::queue_depth(&conn, &setup.topology.queue(&setup.group)).await,
        amqp::queue_depth(&conn, &setup.topology.dlq(&setup.group)).await,
    );
    let _ = conn.close(200, "done".into()).await;
    setup.cleanup().await;
    assert!(
        finished,
        "{name}: neighbours applied {found:?} of {expected:?}; (queue, dlq) ready {depths:?}; \
         dead letters {:?}; {stats:?}",
        dead.iter()
            .map(|d| (&d.key, &d.reason, &d.last_error))
            .collect::<Vec<_>>()
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
    if !frames_gate("frames_a_message_id_that_is_not_utf8") {
        return;
    }
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
    if !frames_gate("frames_a_type_that_is_not_utf8") {
        return;
    }
    let props = raw::Properties {
        message_id: Some(b"raw-bad-type".to_vec()),
        message_type: Some(b"usage.\xc3\x28".to_vec()),
        headers: None,
    };
    raw_poison_between_neighbours("a type that is not UTF-8", props, Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_a_header_name_that_is_not_utf8() {
    if !frames_gate("frames_a_header_name_that_is_not_utf8") {
        return;
    }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_a_table_nested_five_thousand_levels_deep() {
    if !frames_gate("frames_a_table_nested_five_thousand_levels_deep") {
        return;
    }
    let props = raw::Properties {
        message_id: Some(b"raw-deep-5000".to_vec()),
        message_type: Some(MESSAGE_TYPE.as_bytes().to_vec()),
        headers: Some(raw::table(&[(b"deep", raw::nested_table_value(5_000))])),
    };
    raw_poison_between_neighbours(
        "a table nested 5,000 levels",
        props,
        Duration::from_secs(60),
    )
    .await;
}
