//! An upgrade from 0.1.0: a schema at exactly 0.1.0's migrations (applied from a
//! committed copy, `tests/fixtures/schema-0.1.0/`, under their own version numbers),
//! holding rows as 0.1.0's code wrote them, is opened by the current store. Every row
//! must keep its meaning: nothing lost, every claim decided as before, the outbox
//! backlog relayed once, dead letters listed and replayed where their reason allows.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Integer, Nullable, Text};
use diesel::{PgConnection, SqliteConnection};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
use inbox_core::{
    payload_digest, relay_in_process, DeadLetterReason, Decision, EnqueueOutcome, Envelope,
    InProcessTransport, ManualClock, MessageKey, OutboxMessage, OutboxStore,
};

use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Relay, RelaySettings};
use inbox_diesel::operator::Operator;
use inbox_diesel::operator::{
    DeadLetterFilter, LetterStatus, RedriveFilter, ReplayOutcome, ReplayTarget,
};
use inbox_diesel::{enqueue, ClaimStatus, Retention, Store, StoreConnection};
use inbox_test_support::amqp::{self, eventually, Outgoing};
use inbox_test_support::{group, ms, start_time, usage, Fixture, PgFixture, Recorder, TestConn};

/// 0.1.0's migrations, as they stood at its release.
const PG_0_1_0: EmbeddedMigrations = embed_migrations!("fixtures/schema-0.1.0/postgres");
const SQLITE_0_1_0: EmbeddedMigrations = embed_migrations!("fixtures/schema-0.1.0/sqlite");
/// The current migrations, to bring a schema to the version just before one of them.
const PG_CURRENT: EmbeddedMigrations = embed_migrations!("../inbox-diesel/migrations/postgres");
const SQLITE_CURRENT: EmbeddedMigrations = embed_migrations!("../inbox-diesel/migrations/sqlite");

const GROUP: &str = "billing.upgrade";
const TYPE: &str = "usage.recorded";

/// The payload most rows carry, and its SHA-256 as 0.1.0 stored it (computed
/// outside this code base: `printf '{"amount":10}' | sha256sum`).
const PAYLOAD: &[u8] = br#"{"amount":10}"#;
const PAYLOAD_SHA256: &str = "a8b88b82fe90a16048eb8851fe382405395cd395dafaa7ca9be90ec00f82a72b";
/// Another message under a claimed key (a key collision's newcomer).
const IMPOSTOR: &[u8] = br#"{"amount":99}"#;
const IMPOSTOR_SHA256: &str = "2166059e526b50f65c44d4c4ce2a08b79bab73530cbe45ea35763397295c5239";
/// A payload the handler's message type does not decode from.
const GARBLED: &[u8] = b"not json";
const GARBLED_SHA256: &str = "7ccfa1fbf3940e6f0c0375d87c0f9235a50514e14cb427bdfaf5077987b26ccf";

fn sha256(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

fn at(minutes: i64) -> DateTime<Utc> {
    start_time() + TimeDelta::minutes(minutes)
}

/// A claim row as 0.1.0 left it.
struct OldClaim {
    key: &'static str,
    message_type: &'static str,
    tenant: Option<&'static str>,
    digest: Vec<u8>,
    status: &'static str,
    attempts: i32,
    starts: i32,
    next_attempt_at: Option<DateTime<Utc>>,
    last_error: Option<&'static str>,
    payload: Option<&'static [u8]>,
    first_seen_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

/// A dead letter as 0.1.0 wrote it.
struct OldLetter {
    key: &'static str,
    message_type: &'static str,
    /// The type the upgrade gives it, where 0.1.0 stored a queue's name instead.
    repaired_type: Option<&'static str>,
    tenant: Option<&'static str>,
    payload: &'static [u8],
    headers: BTreeMap<String, String>,
    attempts: i32,
    reason: &'static str,
    last_error: &'static str,
    dead_lettered_at: DateTime<Utc>,
}

/// An outbox row as 0.1.0 wrote (and perhaps published) it.
struct OldOutbox {
    key: &'static str,
    message_type: &'static str,
    tenant: Option<&'static str>,
    headers: BTreeMap<String, String>,
    ordering_key: Option<&'static str>,
    created_at: DateTime<Utc>,
    available_at: DateTime<Utc>,
    leased_until: Option<DateTime<Utc>>,
    leased_by: Option<&'static str>,
    published_at: Option<DateTime<Utc>>,
    attempts: i32,
    last_error: Option<&'static str>,
}

fn headers(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn claim(key: &'static str, status: &'static str) -> OldClaim {
    OldClaim {
        key,
        message_type: TYPE,
        tenant: Some("acme"),
        digest: sha256(PAYLOAD_SHA256),
        status,
        attempts: 0,
        starts: 0,
        next_attempt_at: None,
        last_error: None,
        payload: None,
        first_seen_at: at(-120),
        updated_at: at(-60),
    }
}

/// The claims: every state 0.1.0 wrote, each as its own code path left it.
fn old_claims() -> Vec<OldClaim> {
    vec![
        // A first delivery, handled.
        claim("c-done", "done"),
        // Handled after two failures: the claim statement that took it kept attempts,
        // the error and the due time, and dropped the payload.
        OldClaim {
            attempts: 2,
            next_attempt_at: Some(at(-61)),
            last_error: Some("handler failed: upstream timed out"),
            ..claim("c-done-after-retries", "done")
        },
        // A failure whose retry is due: the payload kept, to redrive.
        OldClaim {
            attempts: 1,
            next_attempt_at: Some(at(-5)),
            last_error: Some("handler failed: connection reset"),
            payload: Some(PAYLOAD),
            ..claim("c-failed-due", "failed")
        },
        // A failure whose retry is not due yet.
        OldClaim {
            attempts: 1,
            next_attempt_at: Some(at(10)),
            last_error: Some("handler failed: rate limited"),
            payload: Some(PAYLOAD),
            ..claim("c-failed-later", "failed")
        },
        // A redelivery's start mark whose process died: a stale start.
        OldClaim {
            starts: 1,
            payload: Some(PAYLOAD),
            ..claim("c-started-stale", "started")
        },
        // A start mark over an earlier failure.
        OldClaim {
            attempts: 1,
            starts: 1,
            next_attempt_at: Some(at(-30)),
            last_error: Some("handler failed: deadlock"),
            payload: Some(PAYLOAD),
            ..claim("c-started-after-failure", "started")
        },
        // Three starts without an outcome: the next redelivery is a crash loop.
        OldClaim {
            starts: 3,
            payload: Some(PAYLOAD),
            ..claim("c-started-crashing", "started")
        },
        // Dead after its last attempt (its letter below).
        OldClaim {
            attempts: 5,
            last_error: Some("handler failed: upstream timed out"),
            ..claim("c-dead-max-attempts", "dead")
        },
        OldClaim {
            attempts: 1,
            last_error: Some("handler failed: account closed"),
            ..claim("c-dead-permanent", "dead")
        },
        OldClaim {
            attempts: 1,
            digest: sha256(GARBLED_SHA256),
            last_error: Some("payload does not decode: expected ident at line 1 column 2"),
            ..claim("c-dead-decode", "dead")
        },
        // Dead as a crash loop: the crash-loop update zeroed starts, counted no attempt.
        OldClaim {
            last_error: Some("crash loop: 3 starts without an outcome (limit 3)"),
            ..claim("c-dead-crash-loop", "dead")
        },
        // Marked dead by the broker's delivery limit (`mark_dead`).
        OldClaim {
            last_error: Some("x-delivery-limit reached"),
            ..claim("c-dead-delivery-limit", "dead")
        },
        OldClaim {
            message_type: "usage.unknown",
            attempts: 1,
            last_error: Some(
                "no handler in group billing.upgrade takes message type \"usage.unknown\"",
            ),
            ..claim("c-dead-no-handler", "dead")
        },
        // The claim a key collision's newcomer met: done, left untouched.
        claim("c-collided", "done"),
        // A failure whose retry copy the broker lost: redriven from its payload.
        OldClaim {
            attempts: 1,
            next_attempt_at: Some(at(-50)),
            last_error: Some("handler failed: connection reset"),
            payload: Some(PAYLOAD),
            ..claim("c-failed-lost", "failed")
        },
        // A message published without a `type` property: 0.1.0 took its type from the
        // routing key, which the retry tier had replaced by the group queue's name, so
        // its retry found no handler.
        OldClaim {
            attempts: 1,
            last_error: Some(
                "no handler in group billing.upgrade takes message type \"billing.upgrade\"",
            ),
            ..claim("c-untyped-retried", "dead")
        },
        // The same, dead-lettered by the broker at its delivery limit: the routing key
        // was the `:dlq` queue's name. Its start marks stay (`mark_dead` kept them).
        OldClaim {
            starts: 2,
            last_error: Some("the broker dead-lettered the message (delivery_limit)"),
            ..claim("c-untyped-delivery-limit", "dead")
        },
    ]
}

fn letter(
    key: &'static str,
    reason: &'static str,
    attempts: i32,
    last_error: &'static str,
) -> OldLetter {
    OldLetter {
        key,
        message_type: TYPE,
        repaired_type: None,
        tenant: Some("acme"),
        payload: PAYLOAD,
        headers: headers(&[("tenant", "acme"), ("x-delivery-count", "1")]),
        attempts,
        reason,
        last_error,
        dead_lettered_at: at(-60),
    }
}

/// A dead letter of every reason 0.1.0 wrote.
fn old_letters() -> Vec<OldLetter> {
    vec![
        letter(
            "c-dead-max-attempts",
            "max_attempts",
            5,
            "handler failed: upstream timed out",
        ),
        letter(
            "c-dead-permanent",
            "permanent",
            1,
            "handler failed: account closed",
        ),
        OldLetter {
            payload: GARBLED,
            ..letter(
                "c-dead-decode",
                "decode_error",
                1,
                "payload does not decode: expected ident at line 1 column 2",
            )
        },
        letter(
            "c-dead-crash-loop",
            "crash_loop",
            0,
            "crash loop: 3 starts without an outcome (limit 3)",
        ),
        OldLetter {
            headers: headers(&[
                ("tenant", "acme"),
                ("x-delivery-count", "3"),
                ("x-first-death-reason", "delivery_limit"),
            ]),
            ..letter(
                "c-dead-delivery-limit",
                "delivery_limit",
                0,
                "x-delivery-limit reached",
            )
        },
        OldLetter {
            message_type: "usage.unknown",
            ..letter(
                "c-dead-no-handler",
                "no_handler",
                1,
                "no handler in group billing.upgrade takes message type \"usage.unknown\"",
            )
        },
        OldLetter {
            payload: IMPOSTOR,
            headers: BTreeMap::new(),
            ..letter(
                "c-collided",
                "key_collision",
                0,
                "key collision: payload digest differs from the stored claim under key c-collided",
            )
        },
        OldLetter {
            message_type: "billing.upgrade",
            repaired_type: Some(TYPE),
            headers: headers(&[
                ("x-first-death-exchange", ""),
                ("x-first-death-queue", "billing.upgrade:retry:1s"),
                ("x-first-death-reason", "expired"),
            ]),
            ..letter(
                "c-untyped-retried",
                "no_handler",
                1,
                "no handler in group billing.upgrade takes message type \"billing.upgrade\"",
            )
        },
        OldLetter {
            message_type: "billing.upgrade:dlq",
            repaired_type: Some(TYPE),
            headers: headers(&[
                ("x-delivery-count", "3"),
                ("x-first-death-exchange", ""),
                ("x-first-death-queue", "billing.upgrade"),
                ("x-first-death-reason", "delivery_limit"),
            ]),
            ..letter(
                "c-untyped-delivery-limit",
                "delivery_limit",
                0,
                "the broker dead-lettered the message (delivery_limit)",
            )
        },
        // The transport made the key up (no claim): 0.1.0 derived it from the body.
        OldLetter {
            tenant: None,
            headers: BTreeMap::new(),
            ..letter(
                "5d0c8e2a-58a1-5b5c-9d3e-2f6a1c0b7e41",
                "malformed",
                0,
                "no message_id property",
            )
        },
    ]
}

fn outbox(key: &'static str) -> OldOutbox {
    OldOutbox {
        key,
        message_type: TYPE,
        tenant: None,
        headers: BTreeMap::new(),
        ordering_key: None,
        created_at: at(-30),
        available_at: at(-30),
        leased_until: None,
        leased_by: None,
        published_at: None,
        attempts: 0,
        last_error: None,
    }
}

/// Outbox rows: published and not, with and without headers, ordered and failed.
fn old_outbox() -> Vec<OldOutbox> {
    vec![
        OldOutbox {
            leased_until: Some(at(-29)),
            leased_by: Some("relay-0.1.0"),
            published_at: Some(at(-29)),
            ..outbox("o-published")
        },
        OldOutbox {
            tenant: Some("acme"),
            headers: headers(&[("source", "billing"), ("tenant", "acme")]),
            leased_until: Some(at(-29)),
            leased_by: Some("relay-0.1.0"),
            published_at: Some(at(-29)),
            ..outbox("o-published-headers")
        },
        outbox("o-pending"),
        OldOutbox {
            tenant: Some("acme"),
            headers: headers(&[("source", "billing"), ("trace", "abc")]),
            ..outbox("o-pending-headers")
        },
        OldOutbox {
            ordering_key: Some("user-42"),
            ..outbox("o-ordered-1")
        },
        OldOutbox {
            ordering_key: Some("user-42"),
            created_at: at(-29),
            available_at: at(-29),
            ..outbox("o-ordered-2")
        },
        // Failed twice; its lease ran out, due again.
        OldOutbox {
            leased_until: Some(at(-20)),
            leased_by: Some("relay-0.1.0"),
            attempts: 2,
            last_error: Some("broker nacked the publication"),
            available_at: at(-19),
            ..outbox("o-failed")
        },
        // Failed more often than today's relays try a row (0.1.0 never gave up on
        // one), and no group takes its type: dead at its next failure.
        OldOutbox {
            message_type: "usage.nobody",
            leased_until: Some(at(-20)),
            leased_by: Some("relay-0.1.0"),
            attempts: 25,
            last_error: Some("unroutable"),
            ..outbox("o-failing")
        },
    ]
}

/// What the test writes as 0.1.0 did, on each backend with its own timestamp type.
trait OldStore: TestConn + StoreConnection {
    /// The backend's migration folder.
    const BACKEND: &'static str;
    /// 0.1.0's migrations, through diesel's harness as 0.1.0 ran them.
    fn migrate_0_1_0(&mut self) -> Vec<String>;
    fn write_claim(&mut self, group: &str, c: &OldClaim);
    fn write_letter(&mut self, group: &str, l: &OldLetter);
    fn write_outbox(&mut self, exchange: &str, o: &OldOutbox);
    /// 0.1.0's `enqueue` statement: `ON CONFLICT (message_key) DO NOTHING`.
    fn enqueue_as_0_1_0(&mut self, key: &str) -> QueryResult<Option<i64>>;
    fn count(&mut self, sql: &str) -> i64;
    fn versions(&mut self) -> Vec<String>;
    /// The version of the migration that made lease tokens random.
    const RANDOM_TOKENS: &'static str;
    /// Runs the current migrations older than `version`; returns their versions.
    fn migrate_before(&mut self, version: &str) -> Vec<String>;
    /// An idempotency record as the code before random tokens wrote it: its token a
    /// counter (BIGINT).
    fn write_counter_record(&mut self, r: &OldRecord);
}

/// An idempotency record of the counter-token schema.
struct OldRecord {
    key: &'static str,
    fingerprint: Vec<u8>,
    status: &'static str,
    token: i64,
    lease_until: DateTime<Utc>,
    committed_at: Option<DateTime<Utc>>,
    response: Option<&'static [u8]>,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct Version {
    #[diesel(sql_type = Text)]
    version: String,
}

macro_rules! old_store {
    ($conn:ty, $backend:literal, $ts:ty, $migrations:expr, $current:expr, $random:literal) => {
        impl OldStore for $conn {
            const BACKEND: &'static str = $backend;
            const RANDOM_TOKENS: &'static str = $random;

            fn migrate_before(&mut self, version: &str) -> Vec<String> {
                let pending = self.pending_migrations($current).unwrap();
                let mut ran = Vec::new();
                for m in pending {
                    let v = m.name().version().to_string();
                    if v.as_str() >= version {
                        break;
                    }
                    self.run_migration(&*m).unwrap();
                    ran.push(v);
                }
                ran
            }

            fn write_counter_record(&mut self, r: &OldRecord) {
                diesel::sql_query(
                    "INSERT INTO idempotency_keys (caller, idempotency_key, fingerprint, \
                     status, lease_token, lease_until, committed_at, response, created_at, \
                     updated_at) VALUES ('acct', $1, $2, $3, $4, $5, $6, $7, $8, $8)",
                )
                .bind::<Text, _>(r.key)
                .bind::<Binary, _>(&r.fingerprint)
                .bind::<Text, _>(r.status)
                .bind::<BigInt, _>(r.token)
                .bind::<$ts, _>(r.lease_until)
                .bind::<Nullable<$ts>, _>(r.committed_at)
                .bind::<Nullable<Binary>, _>(r.response)
                .bind::<$ts, _>(start_time())
                .execute(self)
                .unwrap();
            }

            fn migrate_0_1_0(&mut self) -> Vec<String> {
                self.run_pending_migrations($migrations)
                    .unwrap()
                    .into_iter()
                    .map(|v| v.to_string())
                    .collect()
            }

            fn write_claim(&mut self, group: &str, c: &OldClaim) {
                diesel::sql_query(
                    "INSERT INTO inbox_claims (consumer_group, message_key, message_type, \
                     tenant, payload_digest, status, attempts, starts, next_attempt_at, \
                     last_error, payload, first_seen_at, updated_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
                )
                .bind::<Text, _>(group)
                .bind::<Text, _>(c.key)
                .bind::<Text, _>(c.message_type)
                .bind::<Nullable<Text>, _>(c.tenant)
                .bind::<Binary, _>(&c.digest)
                .bind::<Text, _>(c.status)
                .bind::<Integer, _>(c.attempts)
                .bind::<Integer, _>(c.starts)
                .bind::<Nullable<$ts>, _>(c.next_attempt_at)
                .bind::<Nullable<Text>, _>(c.last_error)
                .bind::<Nullable<Binary>, _>(c.payload)
                .bind::<$ts, _>(c.first_seen_at)
                .bind::<$ts, _>(c.updated_at)
                .execute(self)
                .unwrap();
            }

            fn write_letter(&mut self, group: &str, l: &OldLetter) {
                // 0.1.0: `serde_json::to_string(&env.headers)`.
                let headers = serde_json::to_string(&l.headers).unwrap();
                diesel::sql_query(
                    "INSERT INTO inbox_dead_letters (consumer_group, message_key, message_type, \
                     tenant, payload, headers, attempts, reason, last_error, dead_lettered_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                )
                .bind::<Text, _>(group)
                .bind::<Text, _>(l.key)
                .bind::<Text, _>(l.message_type)
                .bind::<Nullable<Text>, _>(l.tenant)
                .bind::<Binary, _>(l.payload)
                .bind::<Text, _>(headers)
                .bind::<Integer, _>(l.attempts)
                .bind::<Text, _>(l.reason)
                .bind::<Nullable<Text>, _>(Some(l.last_error))
                .bind::<$ts, _>(l.dead_lettered_at)
                .execute(self)
                .unwrap();
            }

            fn write_outbox(&mut self, exchange: &str, o: &OldOutbox) {
                let headers = serde_json::to_string(&o.headers).unwrap();
                diesel::sql_query(
                    "INSERT INTO outbox_messages (message_key, exchange, routing_key, \
                     message_type, tenant, payload, headers, ordering_key, created_at, \
                     available_at, leased_until, leased_by, published_at, attempts, last_error) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)",
                )
                .bind::<Text, _>(o.key)
                .bind::<Text, _>(exchange)
                .bind::<Text, _>(o.message_type)
                .bind::<Text, _>(o.message_type)
                .bind::<Nullable<Text>, _>(o.tenant)
                .bind::<Binary, _>(PAYLOAD)
                .bind::<Text, _>(headers)
                .bind::<Nullable<Text>, _>(o.ordering_key)
                .bind::<$ts, _>(o.created_at)
                .bind::<$ts, _>(o.available_at)
                .bind::<Nullable<$ts>, _>(o.leased_until)
                .bind::<Nullable<Text>, _>(o.leased_by)
                .bind::<Nullable<$ts>, _>(o.published_at)
                .bind::<Integer, _>(o.attempts)
                .bind::<Nullable<Text>, _>(o.last_error)
                .execute(self)
                .unwrap();
            }

            fn enqueue_as_0_1_0(&mut self, key: &str) -> QueryResult<Option<i64>> {
                diesel::sql_query(
                    "INSERT INTO outbox_messages (message_key, exchange, routing_key, \
                     message_type, payload, headers, created_at, available_at, attempts) \
                     VALUES ($1, $2, $3, $3, $4, '{}', $5, $5, 0) \
                     ON CONFLICT (message_key) DO NOTHING RETURNING id AS n",
                )
                .bind::<Text, _>(key)
                .bind::<Text, _>(EXCHANGE)
                .bind::<Text, _>(TYPE)
                .bind::<Binary, _>(PAYLOAD)
                .bind::<$ts, _>(start_time())
                .get_result::<Count>(self)
                .optional()
                .map(|row| row.map(|r| r.n))
            }

            fn count(&mut self, sql: &str) -> i64 {
                diesel::sql_query(sql).get_result::<Count>(self).unwrap().n
            }

            fn versions(&mut self) -> Vec<String> {
                diesel::sql_query(
                    "SELECT version FROM __diesel_schema_migrations ORDER BY version",
                )
                .load::<Version>(self)
                .unwrap()
                .into_iter()
                .map(|v| v.version)
                .collect()
            }
        }
    };
}

old_store!(
    PgConnection,
    "postgres",
    diesel::sql_types::Timestamptz,
    PG_0_1_0,
    PG_CURRENT,
    "00000000000010"
);
old_store!(
    SqliteConnection,
    "sqlite",
    diesel::sql_types::TimestamptzSqlite,
    SQLITE_0_1_0,
    SQLITE_CURRENT,
    "00000000000009"
);

/// The versions of the current migrations of `backend` (`postgres`, `sqlite`).
fn current_versions(backend: &str) -> Vec<String> {
    let dir = format!(
        "{}/../inbox-diesel/migrations/{backend}",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut versions: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.split('_').next().unwrap().to_owned()
        })
        .collect();
    versions.sort();
    versions
}

const EXCHANGE: &str = "billing";

/// A schema at 0.1.0, holding 0.1.0's rows; returns the id of the last outbox row
/// 0.1.0 wrote, which its retention has deleted since.
fn build_0_1_0<F: Fixture>(fx: &F) -> i64
where
    F::Conn: OldStore,
{
    build_0_1_0_for(fx, EXCHANGE)
}

/// [`build_0_1_0`], with the outbox rows addressed to `exchange`.
fn build_0_1_0_for<F: Fixture>(fx: &F, exchange: &str) -> i64
where
    F::Conn: OldStore,
{
    let mut conn = fx.connect();
    let ran = conn.migrate_0_1_0();
    let backend = if F::Conn::BACKEND == "postgres" {
        vec!["00000000000001", "00000000000002", "00000000000003"]
    } else {
        vec!["00000000000001", "00000000000002"]
    };
    assert_eq!(ran, backend, "0.1.0's migrations under their own versions");
    assert_eq!(conn.versions(), backend);
    for c in old_claims() {
        conn.write_claim(GROUP, &c);
    }
    for l in old_letters() {
        conn.write_letter(GROUP, &l);
    }
    for o in old_outbox() {
        conn.write_outbox(exchange, &o);
    }
    conn.write_outbox(
        exchange,
        &OldOutbox {
            published_at: Some(at(-28)),
            ..outbox("o-purged")
        },
    );
    let purged = conn.count("SELECT MAX(id) AS n FROM outbox_messages");
    // 0.1.0's retention of published rows.
    fx.execute("DELETE FROM outbox_messages WHERE message_key = 'o-purged'");
    purged
}

/// The current store on `fx`, and the keys its handler was called with, in order.
fn store_on<F: Fixture>(fx: &F, clock: &ManualClock) -> (Arc<Store<F::Conn>>, Calls) {
    let recorder = Recorder::new(GROUP);
    let calls = recorder.calls();
    let store = fx.open(
        fx.builder()
            .clock(Arc::new(clock.clone()))
            .handler(recorder),
    );
    (Arc::new(store), calls)
}

type Calls = Arc<std::sync::Mutex<Vec<String>>>;

/// Relays until no live row is unpublished; returns how many rows were published.
/// On PostgreSQL a row with an ordering key waits until every transaction older than
/// its own has ended, in any session of the server (another program's long
/// transaction too): this waits for that, for at most 120 s of wall time.
fn relay_all<C: StoreConnection>(
    store: &Arc<Store<C>>,
    transport: &mut InProcessTransport<Arc<Store<C>>>,
    relay: &str,
) -> usize {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut relayed = 0;
    loop {
        let n = relay_in_process(&**store, transport, relay, 100).unwrap();
        relayed += n;
        if store.oldest_unpublished_age().unwrap().is_none() {
            return relayed;
        }
        assert!(Instant::now() < deadline, "rows left unpublished");
        if n == 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Whether a letter of `reason` may be replayed.
fn replayable(reason: &str) -> bool {
    !matches!(reason, "key_collision" | "malformed" | "decode_error")
}

fn delivery(key: &str, payload: &[u8]) -> Envelope {
    let mut env = usage(key, 0);
    env.payload = payload.to_vec();
    env.tenant = Some("acme".to_owned());
    env
}

fn decide<C: StoreConnection>(store: &Store<C>, env: Envelope) -> Decision {
    let mut decisions = store.process_batch(&group(GROUP), &[env]).unwrap();
    assert_eq!(decisions.len(), 1);
    decisions.pop().unwrap()
}

fn status_of<C: StoreConnection>(store: &Store<C>, key: &str) -> ClaimStatus {
    store
        .claim_record(&inbox_test_support::claim_key(GROUP, key))
        .unwrap()
        .unwrap()
        .status
}

/// The digest 0.1.0 stored is the digest the store computes today: otherwise every
/// redelivery of a message claimed before the upgrade would be a key collision.
#[test]
fn the_digest_is_the_one_0_1_0_stored() {
    for (payload, hex) in [
        (PAYLOAD, PAYLOAD_SHA256),
        (IMPOSTOR, IMPOSTOR_SHA256),
        (GARBLED, GARBLED_SHA256),
    ] {
        assert_eq!(payload_digest(payload).to_vec(), sha256(hex));
        assert_eq!(
            delivery("k", payload).payload_digest().to_vec(),
            sha256(hex)
        );
    }
}

/// Opens the current store on a 0.1.0 schema and checks that nothing was lost and
/// every row means what it meant.
fn upgrade_keeps_every_row<F: Fixture>(fx: &F)
where
    F::Conn: OldStore,
{
    let purged = build_0_1_0(fx);
    let clock = ManualClock::new(start_time());
    let (store, calls) = store_on(fx, &clock);
    store.verify_schema().unwrap();
    let mut conn = fx.connect();
    assert_eq!(
        conn.versions(),
        current_versions(F::Conn::BACKEND),
        "every current migration ran, after 0.1.0's"
    );

    // Nothing lost: the same rows, every column read back as written.
    let claims = old_claims();
    let letters = old_letters();
    let rows = old_outbox();
    let mut n = |t: &str| conn.count(&format!("SELECT COUNT(*) AS n FROM {t}"));
    assert_eq!(n("inbox_claims"), claims.len() as i64);
    assert_eq!(n("inbox_dead_letters"), letters.len() as i64);
    assert_eq!(n("outbox_messages"), rows.len() as i64);
    for c in &claims {
        let r = store
            .claim_record(&inbox_test_support::claim_key(GROUP, c.key))
            .unwrap()
            .unwrap_or_else(|| panic!("claim {} lost", c.key));
        assert_eq!(r.status.as_str(), c.status, "{}", c.key);
        assert_eq!(r.message_type, c.message_type, "{}", c.key);
        assert_eq!(r.tenant.as_deref(), c.tenant, "{}", c.key);
        assert_eq!(r.attempts, c.attempts, "{}", c.key);
        assert_eq!(r.starts, c.starts, "{}", c.key);
        assert_eq!(r.next_attempt_at, c.next_attempt_at, "{}", c.key);
        assert_eq!(r.last_error.as_deref(), c.last_error, "{}", c.key);
        assert_eq!(r.has_payload, c.payload.is_some(), "{}", c.key);
        assert_eq!(r.first_seen_at, c.first_seen_at, "{}", c.key);
        assert_eq!(r.updated_at, c.updated_at, "{}", c.key);
    }
    assert_eq!(
        conn.count("SELECT COUNT(*) AS n FROM inbox_claims WHERE covered_at IS NOT NULL"),
        0,
        "no 0.1.0 claim reads as covered by a rebuild"
    );
    let stored = store.dead_letters(&group(GROUP)).unwrap();
    assert_eq!(stored.len(), letters.len());
    for (s, l) in stored.iter().zip(&letters) {
        assert_eq!(s.key, l.key);
        assert_eq!(
            s.message_type,
            l.repaired_type.unwrap_or(l.message_type),
            "{}",
            l.key
        );
        assert_eq!(s.tenant.as_deref(), l.tenant, "{}", l.key);
        assert_eq!(s.payload, l.payload, "{}", l.key);
        assert_eq!(s.payload_cut, None, "{}: stored whole", l.key);
        assert_eq!(s.headers, l.headers, "{}", l.key);
        assert_eq!(s.attempts, l.attempts, "{}", l.key);
        assert_eq!(s.reason.as_str(), l.reason, "{}", l.key);
        assert_eq!(s.last_error.as_deref(), Some(l.last_error), "{}", l.key);
        assert_eq!(s.dead_lettered_at, l.dead_lettered_at, "{}", l.key);
        assert_eq!(s.replayed_at, None, "{}", l.key);
    }
    // The operator API lists every letter as pending, under its own reason.
    let listed = Operator::new(&store)
        .list_dead_letters(&DeadLetterFilter::default(), 0, 100)
        .unwrap();
    assert_eq!(listed.len(), letters.len());
    for l in &letters {
        let e = listed
            .iter()
            .find(|e| e.message_key == l.key)
            .unwrap_or_else(|| panic!("letter {} not listed", l.key));
        assert_eq!(e.reason.as_str(), l.reason);
        assert_eq!(e.status, LetterStatus::Pending, "{}", l.key);
        assert_eq!(e.replay_count, 0, "{}", l.key);
        assert_eq!(e.delivered_by_replay, None, "{}", l.key);
        assert_eq!(
            DeadLetterReason::parse(l.reason),
            Some(e.reason),
            "{}",
            l.key
        );
        let details = Operator::new(&store)
            .dead_letter_details(e.id)
            .unwrap()
            .unwrap();
        assert_eq!(details.payload, l.payload, "{}", l.key);
        assert_eq!(details.headers, l.headers, "{}", l.key);
        assert_eq!(
            details.replay_refusal.is_none(),
            replayable(l.reason),
            "{}",
            l.key
        );
        let claim = claims.iter().find(|c| c.key == l.key);
        assert_eq!(
            details.claim_status.map(|s| s.as_str()),
            claim.map(|c| c.status),
            "{}",
            l.key
        );
    }
    let groups = Operator::new(&store)
        .failure_groups(&DeadLetterFilter::default())
        .unwrap();
    assert_eq!(
        groups.iter().map(|g| g.count).sum::<u64>(),
        letters.len() as u64
    );
    let stats = Operator::new(&store).operator_stats().unwrap();
    let g = stats
        .groups
        .iter()
        .find(|g| g.consumer_group == GROUP)
        .unwrap();
    let of = |status: &str| claims.iter().filter(|c| c.status == status).count() as u64;
    assert_eq!(
        (g.started, g.done, g.failed, g.dead),
        (of("started"), of("done"), of("failed"), of("dead"))
    );
    assert_eq!((g.retries_due, g.retries_waiting), (2, 1));
    assert_eq!(g.oldest_pending_retry, Some(at(-50)));
    assert_eq!(
        stats.dead_letters.iter().map(|c| c.count).sum::<u64>(),
        letters.len() as u64
    );
    assert_eq!(stats.dead_outbox_rows, 0);

    // The outbox: the unpublished rows lease in id order, read back as written; the
    // published ones do not lease.
    let lease = store.lease("check", 100, Duration::from_secs(1)).unwrap();
    assert!(lease.unreadable.is_empty(), "{:?}", lease.unreadable);
    let pending: Vec<&OldOutbox> = rows.iter().filter(|o| o.published_at.is_none()).collect();
    let leased: Vec<&str> = lease
        .rows
        .iter()
        .map(|r| r.message.message_key.as_str())
        .collect();
    // o-ordered-2 waits for o-ordered-1.
    let expected: Vec<&str> = pending
        .iter()
        .map(|o| o.key)
        .filter(|k| *k != "o-ordered-2")
        .collect();
    assert_eq!(leased, expected);
    assert_eq!(stats.outbox_backlog, pending.len() as u64);
    for r in &lease.rows {
        let o = rows
            .iter()
            .find(|o| o.key == r.message.message_key.as_str())
            .unwrap();
        assert_eq!(r.message.exchange, EXCHANGE);
        assert_eq!(r.message.routing_key, o.message_type);
        assert_eq!(r.message.message_type, o.message_type);
        assert_eq!(r.message.payload, PAYLOAD);
        assert_eq!(r.message.headers, o.headers, "{}", o.key);
        assert_eq!(r.message.tenant.as_deref(), o.tenant, "{}", o.key);
        assert_eq!(
            r.message.ordering_key.as_deref(),
            o.ordering_key,
            "{}",
            o.key
        );
        assert_eq!(r.attempts, o.attempts, "{}", o.key);
        assert_eq!(r.created_at, o.created_at, "{}", o.key);
    }
    clock.advance(Duration::from_secs(2));

    // A new row: its id is past every id 0.1.0 handed out, its ordering key waits for
    // 0.1.0's rows of the same key; a 0.1.0 key enqueued again writes nothing.
    let ordered = OutboxMessage::new(
        MessageKey::new("o-new-ordered").unwrap(),
        EXCHANGE,
        TYPE,
        PAYLOAD.to_vec(),
    )
    .with_ordering_key("user-42");
    let again = OutboxMessage::new(
        MessageKey::new("o-pending").unwrap(),
        EXCHANGE,
        TYPE,
        PAYLOAD.to_vec(),
    );
    let mut pooled = store.connection().unwrap();
    let (new, old) = pooled
        .transaction(|c| {
            let new = enqueue(c, &ordered, store.clock().now())?;
            let old = enqueue(c, &again, store.clock().now())?;
            Ok::<_, inbox_diesel::Error>((new, old))
        })
        .unwrap();
    drop(pooled);
    match new {
        EnqueueOutcome::Enqueued { id } => assert!(id > purged, "id {id} after {purged}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(old, EnqueueOutcome::AlreadyEnqueued);
    // A 0.1.0 producer cannot write to the upgraded table (its conflict target, the
    // unique message key, is now (message_key, replay_seq)): stop it before upgrading.
    assert!(conn.enqueue_as_0_1_0("o-old-producer").is_err());

    // Every claim keeps its meaning.
    let before = conn.effect_count().unwrap();
    assert_eq!(before, 0);
    assert_eq!(
        decide(&store, delivery("c-done", PAYLOAD)),
        Decision::Duplicate
    );
    assert_eq!(
        decide(&store, delivery("c-done-after-retries", PAYLOAD)),
        Decision::Duplicate
    );
    assert_eq!(
        decide(&store, delivery("c-collided", PAYLOAD)),
        Decision::Duplicate
    );
    assert_eq!(
        decide(&store, delivery("c-collided", IMPOSTOR)),
        Decision::DeadLettered(DeadLetterReason::KeyCollision),
        "still a collision"
    );
    assert_eq!(
        decide(&store, delivery("c-failed-due", PAYLOAD)),
        Decision::Processed
    );
    assert_eq!(
        decide(&store, delivery("c-failed-due", PAYLOAD)),
        Decision::Duplicate
    );
    assert_eq!(conn.effects_of("c-failed-due").unwrap(), 1);
    assert_eq!(status_of(&store, "c-failed-due"), ClaimStatus::Done);
    match decide(&store, delivery("c-failed-later", PAYLOAD)) {
        Decision::RetryAfter(wait) => assert!(
            wait <= Duration::from_secs(600) && wait > Duration::from_secs(590),
            "{wait:?}"
        ),
        other => panic!("a failure not yet due waits: {other:?}"),
    }
    assert_eq!(conn.effects_of("c-failed-later").unwrap(), 0);
    assert_eq!(
        decide(&store, delivery("c-started-stale", PAYLOAD).redelivered()),
        Decision::Processed,
        "a stale start is taken over"
    );
    assert_eq!(conn.effects_of("c-started-stale").unwrap(), 1);
    assert_eq!(
        decide(&store, delivery("c-started-after-failure", PAYLOAD)),
        Decision::Processed
    );
    assert_eq!(conn.effects_of("c-started-after-failure").unwrap(), 1);
    assert_eq!(
        decide(
            &store,
            delivery("c-started-crashing", PAYLOAD).redelivered()
        ),
        Decision::DeadLettered(DeadLetterReason::CrashLoop),
        "0.1.0's starts count toward the crash limit"
    );
    assert_eq!(conn.effects_of("c-started-crashing").unwrap(), 0);
    for key in [
        "c-dead-max-attempts",
        "c-dead-permanent",
        "c-dead-crash-loop",
        "c-dead-delivery-limit",
    ] {
        assert_eq!(
            decide(&store, delivery(key, PAYLOAD)),
            Decision::AlreadyDeadLettered,
            "{key} stays dead"
        );
        assert_eq!(status_of(&store, key), ClaimStatus::Dead, "{key}");
    }
    let mut decode = delivery("c-dead-decode", GARBLED);
    decode.message_type = TYPE.to_owned();
    assert_eq!(decide(&store, decode), Decision::AlreadyDeadLettered);
    assert_eq!(conn.effect_count().unwrap(), 3);

    // A failure whose retry copy was lost is redriven from the payload 0.1.0 kept.
    let redriven = Operator::new(&store)
        .redrive_failed_claims(
            &RedriveFilter::default()
                .consumer_group(GROUP)
                .overdue_for(Duration::from_secs(600)),
            None,
            &ReplayTarget::default(),
        )
        .unwrap();
    assert_eq!((redriven.matched, redriven.affected), (1, 1));

    // The unpublished rows are relayed once, the published ones never again.
    let mut transport =
        InProcessTransport::new(Arc::clone(&store)).with_clock(Arc::new(clock.clone()));
    let relayed = relay_all(&store, &mut transport, "relay-new");
    assert_eq!(
        relayed,
        pending.len() - 1 + 2,
        "0.1.0's backlog but the row no group takes, the new row, the redrive"
    );
    transport.run_until_idle().unwrap();
    for o in &rows {
        let expected = i64::from(o.published_at.is_none() && o.message_type == TYPE);
        assert_eq!(conn.effects_of(o.key).unwrap(), expected, "{}", o.key);
    }
    let dead = store.dead_outbox_rows(10).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].message_key.as_str(), dead[0].attempts),
        ("o-failing", 26)
    );
    assert_eq!(conn.effects_of("o-new-ordered").unwrap(), 1);
    assert_eq!(conn.effects_of("c-failed-lost").unwrap(), 1);
    let order: Vec<String> = calls
        .lock()
        .unwrap()
        .iter()
        .filter(|k| k.starts_with("o-ordered") || *k == "o-new-ordered")
        .cloned()
        .collect();
    assert_eq!(order, ["o-ordered-1", "o-ordered-2", "o-new-ordered"]);
    assert_eq!(
        conn.count(
            "SELECT COUNT(*) AS n FROM outbox_messages \
             WHERE published_at IS NULL AND dead_at IS NULL"
        ),
        0
    );

    // Dead letters replay where their reason says so, once.
    let target = ReplayTarget::default();
    let ids: BTreeMap<String, i64> = Operator::new(&store)
        .list_dead_letters(&DeadLetterFilter::default(), 0, 100)
        .unwrap()
        .into_iter()
        .filter(|e| {
            letters
                .iter()
                .any(|l| l.key == e.message_key && l.reason == e.reason.as_str())
        })
        .map(|e| (e.message_key, e.id))
        .collect();
    assert_eq!(ids.len(), letters.len());
    for l in &letters {
        let outcome = Operator::new(&store)
            .replay_dead_letter(ids[l.key], &target)
            .unwrap();
        let replayable = replayable(l.reason);
        match outcome {
            ReplayOutcome::Replayed { sequence, .. } => {
                assert!(replayable, "{} replayed", l.reason);
                assert_eq!(sequence, 1, "{}", l.reason);
            }
            ReplayOutcome::Refused { .. } => assert!(!replayable, "{} refused", l.reason),
            other => panic!("{}: {other:?}", l.reason),
        }
    }
    let again = Operator::new(&store)
        .replay_dead_letter(ids["c-dead-max-attempts"], &target)
        .unwrap();
    assert!(
        matches!(again, ReplayOutcome::ClaimNotDead { .. }),
        "{again:?}"
    );
    let replays = relay_in_process(&*store, &mut transport, "relay-new", 100).unwrap();
    let replayed = letters.iter().filter(|l| replayable(l.reason)).count();
    assert_eq!(replays, replayed);
    transport.run_until_idle().unwrap();
    for key in [
        "c-dead-max-attempts",
        "c-dead-permanent",
        "c-dead-crash-loop",
        "c-dead-delivery-limit",
        "c-untyped-retried",
        "c-untyped-delivery-limit",
    ] {
        assert_eq!(conn.effects_of(key).unwrap(), 1, "{key} applied once");
        assert_eq!(status_of(&store, key), ClaimStatus::Done, "{key}");
    }
    // Still no handler takes it: dead-lettered again, under the same reason.
    assert_eq!(status_of(&store, "c-dead-no-handler"), ClaimStatus::Dead);
    assert_eq!(conn.effects_of("c-dead-no-handler").unwrap(), 0);

    // The failure that was not due is retried once it is.
    clock.set(at(11));
    assert_eq!(
        decide(&store, delivery("c-failed-later", PAYLOAD)),
        Decision::Processed
    );
    assert_eq!(conn.effects_of("c-failed-later").unwrap(), 1);
    assert_eq!(status_of(&store, "c-collided"), ClaimStatus::Done);
    assert_eq!(conn.effects_of("c-collided").unwrap(), 0);

    // Retention takes 0.1.0's published rows and done claims by their own times.
    let window = Duration::from_secs(20 * 60);
    let retention = Retention::new(window, window, Duration::from_secs(600)).unwrap();
    assert_eq!(store.purge_published(&retention, 10).unwrap(), 2);
    assert_eq!(store.purge_done_claims(&retention, 10).unwrap(), 3);
    assert!(store
        .claim_record(&inbox_test_support::claim_key(GROUP, "c-done"))
        .unwrap()
        .is_none());
}

/// An idempotency table whose lease tokens are counters (the schema before the
/// migration `random_lease_tokens`), holding a record in each state, is opened by
/// the current store: every record keeps its meaning, every token becomes 16 random
/// bytes (no two alike), a request in flight across the upgrade is fenced off (no
/// process holds its new token) and its key is taken over once its lease ends.
fn upgrade_gives_idempotency_records_random_tokens<F: Fixture>(fx: &F)
where
    F::Conn: OldStore,
{
    use inbox_core::idempotency::{
        IdempotencyAnswer, IdempotencyKey, IdempotencyStatus, Settlement,
    };
    use inbox_core::Clock;
    build_0_1_0(fx);
    let mut conn = fx.connect();
    let ran = conn.migrate_before(F::Conn::RANDOM_TOKENS);
    assert!(!ran.is_empty() && ran.iter().all(|v| v.as_str() < F::Conn::RANDOM_TOKENS));
    let fp = |text: &str| {
        inbox_core::idempotency::RequestFields::new()
            .field("text", text)
            .unwrap()
            .fingerprint(b"api-key")
    };
    let lease_end = start_time() + TimeDelta::seconds(30);
    let records = [
        ("running", "in_flight", 1, None, None),
        ("committed", "in_flight", 3, Some(start_time()), None),
        (
            "delivered",
            "delivered",
            2,
            Some(start_time()),
            Some(&b"saved body"[..]),
        ),
        ("refunded", "refunded", 1, Some(start_time()), None),
    ];
    for (key, status, token, committed_at, response) in records {
        conn.write_counter_record(&OldRecord {
            key,
            fingerprint: fp(key).as_bytes().to_vec(),
            status,
            token,
            lease_until: lease_end,
            committed_at,
            response,
        });
    }
    drop(conn);

    let clock = ManualClock::new(start_time());
    let (store, _) = store_on(fx, &clock);
    store.verify_schema().unwrap();
    let key = |k: &str| IdempotencyKey::new(k).unwrap();
    let read = |k: &str| {
        inbox_diesel::idempotency::request_record(&store, "acct", &key(k))
            .unwrap()
            .unwrap()
    };
    let tokens: std::collections::HashSet<_> =
        records.iter().map(|(k, ..)| read(k).lease_token).collect();
    assert_eq!(tokens.len(), records.len(), "tokens repeat: {tokens:?}");
    assert!(!tokens.contains(&inbox_core::idempotency::LeaseToken::from_bytes([0; 16])));
    for (k, status, _, committed_at, response) in records {
        let r = read(k);
        assert_eq!(r.status.as_str(), status, "{k}");
        assert_eq!(r.committed_at, committed_at, "{k}");
        assert_eq!(r.response.as_deref(), response, "{k}");
        assert_eq!(r.lease_until, lease_end, "{k}");
    }
    let begin = |k: &str| {
        let now = clock.now();
        let mut conn = store.connection().unwrap();
        let (key, fp) = (key(k), fp(k));
        let request = inbox_diesel::idempotency::NewRequest {
            caller: "acct",
            key: &key,
            fingerprint: &fp,
            lease_until: now + TimeDelta::seconds(30),
        };
        inbox_diesel::idempotency::begin_request(&mut *conn, &request, now).unwrap()
    };
    assert_eq!(
        begin("delivered"),
        IdempotencyAnswer::Replay {
            response: b"saved body".to_vec()
        }
    );
    assert_eq!(begin("refunded"), IdempotencyAnswer::Refunded);
    assert_eq!(begin("committed"), IdempotencyAnswer::InFlight);
    assert_eq!(begin("running"), IdempotencyAnswer::InFlight);
    // The committed request is settled with the token it has now.
    let committed = read("committed");
    let mut conn = store.connection().unwrap();
    assert!(inbox_diesel::idempotency::settle_request(
        &mut *conn,
        "acct",
        &key("committed"),
        committed.lease_token,
        &Settlement::Refunded,
        clock.now(),
    )
    .unwrap());
    drop(conn);
    assert_eq!(read("committed").status, IdempotencyStatus::Refunded);
    // The running request's lease ends: a retry takes the key over with a token of
    // its own, and the token the upgrade gave the record commits nothing.
    let migrated = read("running").lease_token;
    clock.advance(Duration::from_secs(30));
    let IdempotencyAnswer::Execute { token } = begin("running") else {
        panic!("the expired key is taken over");
    };
    assert_ne!(token, migrated);
    let mut conn = store.connection().unwrap();
    assert!(matches!(
        inbox_diesel::idempotency::commit_request(
            &mut *conn,
            "acct",
            &key("running"),
            migrated,
            clock.now()
        ),
        Err(inbox_diesel::Error::Fenced { .. })
    ));
    inbox_diesel::idempotency::commit_request(
        &mut *conn,
        "acct",
        &key("running"),
        token,
        clock.now(),
    )
    .unwrap();
}

mod postgres {
    #[test]
    fn upgrade_gives_idempotency_records_random_tokens() {
        if let Some(fx) = inbox_test_support::PgFixture::new() {
            super::upgrade_gives_idempotency_records_random_tokens(&fx);
        }
    }

    #[test]
    fn upgrade_keeps_every_row() {
        if let Some(fx) = inbox_test_support::PgFixture::new() {
            super::upgrade_keeps_every_row(&fx);
        }
    }
}

mod sqlite {
    #[test]
    fn upgrade_gives_idempotency_records_random_tokens() {
        super::upgrade_gives_idempotency_records_random_tokens(
            &inbox_test_support::SqliteFixture::new(),
        );
    }

    #[test]
    fn upgrade_keeps_every_row() {
        super::upgrade_keeps_every_row(&inbox_test_support::SqliteFixture::new());
    }
}

/// PostgreSQL: two stores of the new version open the 0.1.0 schema at the same time
/// (the migration lock lets one migrate, the other then finds nothing to do), and both
/// run the pending work as competing consumers and relays while a third store opens:
/// every effect once.
#[test]
fn postgres_upgrade_with_two_stores_at_once() {
    let Some(fx) = PgFixture::new() else { return };
    build_0_1_0(&fx);
    let clock = ManualClock::new(start_time());
    fx.connect().create_effects().unwrap();
    let gate = Barrier::new(2);
    let running = Barrier::new(3);
    let work = |relay: &str| {
        gate.wait();
        let store = Arc::new(
            fx.builder()
                .clock(Arc::new(clock.clone()))
                .handler(Recorder::new(GROUP))
                .build()
                .unwrap(),
        );
        store.verify_schema().unwrap();
        let mut transport =
            InProcessTransport::new(Arc::clone(&store)).with_clock(Arc::new(clock.clone()));
        // The pending claims come back as the broker would bring them.
        for key in ["c-failed-due", "c-started-after-failure"] {
            transport.publish(delivery(key, PAYLOAD)).unwrap();
        }
        transport
            .publish(delivery("c-started-stale", PAYLOAD).redelivered())
            .unwrap();
        let mut first = true;
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let n = relay_in_process(&*store, &mut transport, relay, 100).unwrap();
            if std::mem::take(&mut first) {
                running.wait();
            }
            transport.run_until_idle().unwrap();
            if n == 0 && store.oldest_unpublished_age().unwrap().is_none() {
                break;
            }
            assert!(Instant::now() < deadline, "rows left unpublished");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    std::thread::scope(|s| {
        let a = s.spawn(|| work("relay-a"));
        let b = s.spawn(|| work("relay-b"));
        let c = s.spawn(|| {
            running.wait();
            let store = fx.builder().clock(Arc::new(clock.clone())).build().unwrap();
            store.verify_schema().unwrap();
        });
        a.join().unwrap();
        b.join().unwrap();
        c.join().unwrap();
    });
    let mut conn = fx.connect();
    assert_eq!(conn.versions(), current_versions("postgres"));
    for key in ["c-failed-due", "c-started-after-failure", "c-started-stale"] {
        assert_eq!(conn.effects_of(key).unwrap(), 1, "{key} applied once");
    }
    for o in old_outbox() {
        let expected = i64::from(o.published_at.is_none() && o.message_type == TYPE);
        assert_eq!(conn.effects_of(o.key).unwrap(), expected, "{}", o.key);
    }
    assert_eq!(
        conn.count(
            "SELECT COUNT(*) AS n FROM outbox_messages \
             WHERE published_at IS NULL AND dead_at IS NULL"
        ),
        0
    );
}

/// PostgreSQL and RabbitMQ: the current AMQP relay publishes 0.1.0's backlog to the
/// test's exchange and the current consumer applies it, together with the copies of
/// 0.1.0's pending claims the broker brings back: every effect once, a `done` claim's
/// copy a duplicate, the published rows never sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_upgrade_over_rabbitmq() {
    let Some(url) = amqp::amqp_url() else { return };
    let Some(fx) = PgFixture::new() else { return };
    let topology = amqp::test_topology(&amqp::unique_prefix("upgrade"), &[50, 100, 200]);
    build_0_1_0_for(&fx, &topology.exchange());
    fx.connect().create_effects().unwrap();
    let store = Arc::new(
        fx.builder()
            .pool_size(4)
            .retry_ladder(topology.retry_ladder().clone())
            .handler(Recorder::new(GROUP))
            .build()
            .unwrap(),
    );
    let topology = topology.with_routes(inbox_core::InboxStore::routes(&*store));
    let conn = amqp::connect(&url).await;
    topology.declare(&conn).await.unwrap();

    let shutdown = CancellationToken::new();
    let consumer = Consumer::new(url.clone(), Arc::clone(&store), topology.clone()).with_settings(
        ConsumerSettings::default()
            .workers(1)
            .prefetch(20)
            .batch(5, ms(5)),
    );
    let consumed = consumer.stats();
    let consuming = tokio::spawn(consumer.run(shutdown.clone()));
    let relay = Relay::new(url.clone(), Arc::clone(&store)).with_settings(
        RelaySettings::default()
            .relay_id("relay-new")
            .lease(100, Duration::from_secs(5))
            .poll_interval(ms(50))
            .retry_after(ms(50))
            .backoff(ms(50), ms(500))
            .connect_timeout(Duration::from_secs(1)),
    );
    let relayed = relay.stats();
    let relaying = tokio::spawn(relay.run(shutdown.clone()));

    // The copies 0.1.0's pending claims were waiting for.
    let channel = amqp::confirm_channel(&conn).await;
    for key in ["c-failed-due", "c-started-after-failure", "c-done"] {
        let msg = Outgoing {
            message_id: Some(key),
            message_type: TYPE,
            body: PAYLOAD,
            tenant: Some("acme"),
        };
        amqp::publish(&channel, &topology.exchange(), &msg).await;
    }
    amqp::wait_for_confirms(&channel).await;

    // Five backlog rows and two claims apply; the `done` copy is a duplicate.
    let settled = eventually(Duration::from_secs(60), || {
        let s = consumed.snapshot();
        s.processed >= 7 && s.duplicates >= 1
    })
    .await;
    assert!(settled, "{:?}", consumed.snapshot());
    let live = || {
        fx.connect().count(
            "SELECT COUNT(*) AS n FROM outbox_messages \
             WHERE published_at IS NULL AND dead_at IS NULL",
        )
    };
    assert!(eventually(Duration::from_secs(30), || live() == 0).await);
    shutdown.cancel();
    consuming.await.unwrap().unwrap();
    relaying.await.unwrap().unwrap();

    let mut db = fx.connect();
    for o in old_outbox() {
        let expected = i64::from(o.published_at.is_none() && o.message_type == TYPE);
        assert_eq!(db.effects_of(o.key).unwrap(), expected, "{}", o.key);
    }
    for key in ["c-failed-due", "c-started-after-failure"] {
        assert_eq!(db.effects_of(key).unwrap(), 1, "{key}");
    }
    assert_eq!(db.effects_of("c-done").unwrap(), 0);
    assert_eq!(db.effect_count().unwrap(), 7);
    let s = consumed.snapshot();
    assert_eq!(
        (s.processed, s.duplicates, s.dead_lettered),
        (7, 1, 0),
        "{s:?}, the relay: {:?}",
        relayed.snapshot()
    );
    // The row no exchange binding takes came back unroutable and died.
    let dead = store.dead_outbox_rows(10).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_key, "o-failing");
    topology.delete(&conn).await.unwrap();
}
