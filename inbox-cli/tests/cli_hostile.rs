//! A hostile publisher's bytes never reach the operator's terminal: the real `inbox`
//! binary over letters, claims and halts whose key, type, tenant, headers, error and
//! payload hold ESC sequences (CSI, OSC 52), BEL, C1 CSI (U+009B), DEL, bidi overrides
//! and newlines forging whole lines. Every command's human output shows them escaped
//! (`inbox_core::display::escape`), one record per line; the JSON documents carry the
//! same values with every such character written as a `\u` escape. A publisher's own
//! `inbox-replay-sequence` header is not shown as a replay's provenance.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::{Command, Output};

use inbox_core::{DeadLetterReason, Decision, Envelope, MessageKey, RetryPolicy};
use inbox_test_support::{group, Fixture, Outcome, PgFixture, Recorder, SqliteFixture};
use serde_json::Value;

const GROUP: &str = "billing.daily-usage";

/// A key that clears the screen, writes the clipboard (OSC 52), rings the bell, starts
/// a C1 CSI sequence, hides text with DEL and a bidi override, and forges a line.
const KEY: &str = "k-\u{1b}[2J\u{1b}]52;c;aGFja2Vk\u{7}\u{9b}31m\u{7f}\u{202e}\n\
                   2026-12-01T00:00:00Z ERROR forged line\r";
const TYPE: &str = "usage.recorded\u{1b}]0;pwned\u{7}\nreplayable          yes";
const TENANT: &str = "acme\u{1b}[8m\u{85}\u{2066}";
const ERROR: &str = "ledger row 7 locked\u{1b}[1A\u{1b}[2K\nreplayable          yes\u{9b}2J";

/// The field lines of `dead-letters show`, before its headers.
const FIELDS: &[&str] = &[
    "id",
    "consumer group",
    "message key",
    "message type",
    "tenant",
    "reason",
    "status",
    "attempts",
    "dead-lettered at",
    "first failure",
    "last failure",
    "replays",
    "last replayed at",
    "delivered by replay",
    "claim",
    "failure group",
    "traceparent",
    "replayable",
    "last error",
];

struct Db {
    url: String,
    schema: Option<String>,
}

fn inbox(db: &Db, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_inbox"));
    cmd.env_remove("INBOX_SCHEMA")
        .env_remove("INBOX_PREFIX")
        .env_remove("AMQP_URL")
        .env("DATABASE_URL", &db.url);
    if let Some(schema) = &db.schema {
        cmd.args(["--schema", schema]);
    }
    cmd.args(args).output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// No control character but the newline that ends a line, no C1 control, no format
/// character (bidi overrides, zero-width), no line or paragraph separator.
fn assert_inert(what: &str, bytes: &[u8]) {
    let printed = text(bytes);
    for (at, c) in printed.char_indices() {
        let bad = (c.is_control() && c != '\n')
            || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{2028}' | '\u{2029}' | '\u{feff}');
        assert!(
            !bad,
            "{what}: raw {c:?} at byte {at} reaches the terminal:\n{printed}"
        );
    }
}

fn hostile(key: &str, message_type: &str, payload: &[u8]) -> Envelope {
    let mut e = Envelope::new(
        MessageKey::new(key).unwrap(),
        message_type,
        payload.to_vec(),
    )
    .with_tenant(TENANT);
    e.headers.insert(
        "x-note\u{1b}]52;c;aGk=\u{7}\nreplayable".to_owned(),
        "v\u{1b}[31m\u{9b}1m\n  forged-header: yes".to_owned(),
    );
    e.headers.insert(
        inbox_core::TRACEPARENT_HEADER.to_owned(),
        "00-\u{1b}[2J\nERROR-fake".to_owned(),
    );
    // A publisher's own replay header: this message was never replayed.
    e.headers.insert(
        inbox_core::REPLAY_SEQUENCE_HEADER.to_owned(),
        "7".to_owned(),
    );
    e
}

/// Two hostile letters (one failed by its handler with a hostile error, one whose
/// hostile type no handler takes, with a payload forging lines), their claims, and a
/// halt with a hostile key and detail.
fn seed<F: Fixture>(fx: &F) {
    let store = fx
        .builder()
        .handler(
            Recorder::new(GROUP)
                .policy(
                    RetryPolicy::new(
                        1,
                        std::time::Duration::from_millis(1),
                        std::time::Duration::from_millis(1),
                    )
                    .unwrap(),
                )
                .behaviour(|_, _| Outcome::FailWith(ERROR.to_owned())),
        )
        .build()
        .unwrap();
    inbox_test_support::TestConn::create_effects(&mut *store.connection().unwrap()).unwrap();
    let g = group(GROUP);
    assert_eq!(
        store
            .process_batch(&g, &[hostile(KEY, "usage.recorded", br#"{"amount":1}"#)])
            .unwrap(),
        [Decision::DeadLettered(DeadLetterReason::MaxAttempts)]
    );
    let payload = "{\"amount\":1}\n\u{1b}[31mERROR forged payload line\u{7}\u{9b}0m\u{202e}";
    assert_eq!(
        store
            .process_batch(&g, &[hostile("k-2\u{1b}c", TYPE, payload.as_bytes())])
            .unwrap(),
        [Decision::DeadLettered(DeadLetterReason::NoHandler)]
    );
    inbox_core::GroupHalts::record_halt(
        &store,
        &inbox_core::ClaimInvariantViolated {
            group: group("billing.audit"),
            key: MessageKey::new(KEY).unwrap(),
            detail: format!("insert conflicted but no row exists\n{ERROR}"),
        },
    )
    .unwrap();
}

fn scenario(db: &Db) {
    let list = inbox(db, &["--json", "dead-letters", "list"]);
    assert_eq!(list.status.code(), Some(0), "{}", text(&list.stderr));
    assert_inert("dead-letters list --json", &list.stdout);
    let letters: Value = serde_json::from_slice(&list.stdout).unwrap();
    let letters = letters["dead_letters"].as_array().unwrap().clone();
    assert_eq!(letters.len(), 2, "{letters:?}");
    // The JSON keeps the values exactly.
    assert_eq!(letters[1]["message_key"], KEY);
    assert_eq!(letters[1]["tenant"], TENANT);
    assert_eq!(letters[0]["message_type"], TYPE);
    // A publisher's header is no replay's provenance.
    for letter in &letters {
        assert_eq!(letter["delivered_by_replay"], Value::Null, "{letter}");
    }

    // Tables: a header, one line per record, a summary.
    for (args, records) in [
        (&["dead-letters", "list"][..], 2),
        (&["dead-letters", "groups"][..], 2),
        (&["claims", "show", KEY][..], 1),
        (&["groups", "list"][..], 1),
    ] {
        let out = inbox(db, args);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert_inert(&format!("{args:?}"), &out.stdout);
        assert_inert(&format!("{args:?} stderr"), &out.stderr);
        let printed = text(&out.stdout);
        assert_eq!(printed.lines().count(), records + 2, "{args:?}:\n{printed}");
        assert!(!printed.contains("\nreplayable"), "{printed}");
        assert!(
            !printed.contains("\n2026-12-01T00:00:00Z ERROR"),
            "{printed}"
        );
    }
    let stats = inbox(db, &["stats"]);
    assert_eq!(stats.status.code(), Some(0), "{}", text(&stats.stderr));
    assert_inert("stats", &stats.stdout);

    // `show`: every line is one of its fields, each once; the forged lines are not.
    for letter in &letters {
        let id = letter["id"].as_i64().unwrap().to_string();
        let out = inbox(db, &["dead-letters", "show", &id]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert_inert("dead-letters show", &out.stdout);
        let printed = text(&out.stdout);
        let lines: Vec<&str> = printed.lines().collect();
        let replayable = lines.iter().filter(|l| l.starts_with("replayable")).count();
        assert_eq!(replayable, 1, "{printed}");
        assert!(
            !printed.contains("delivered by replay"),
            "a publisher's header shown as a replay:\n{printed}"
        );
        let headers = lines.iter().position(|l| *l == "headers:").unwrap();
        let payload = lines
            .iter()
            .position(|l| l.starts_with("payload ("))
            .unwrap();
        // Three headers, one line each; the payload on one line after its title.
        assert_eq!(payload - headers - 1, 3, "{printed}");
        assert_eq!(lines.len(), payload + 2, "{printed}");
        for line in &lines[..headers] {
            assert!(
                FIELDS
                    .iter()
                    .any(|f| line.starts_with(&format!("{f:<20} "))),
                "a line that is no field: {line:?}\n{printed}"
            );
        }
        let json = inbox(db, &["--json", "dead-letters", "show", &id]);
        assert_inert("dead-letters show --json", &json.stdout);
        let json: Value = serde_json::from_slice(&json.stdout).unwrap();
        assert_eq!(json["delivered_by_replay"], Value::Null, "{json}");
        assert_eq!(json["headers"][inbox_core::REPLAY_SEQUENCE_HEADER], "7");
    }

    // The key named on the command line is escaped in the error too.
    let missing = inbox(db, &["claims", "show", &format!("{KEY}-missing")]);
    assert_eq!(missing.status.code(), Some(4));
    assert_inert("claims show (missing)", &missing.stdout);
    assert_inert("claims show (missing) stderr", &missing.stderr);
    assert_eq!(
        text(&missing.stderr).lines().count(),
        1,
        "{}",
        text(&missing.stderr)
    );
}

#[test]
fn sqlite_hostile_values_are_escaped_one_record_per_line() {
    let fx = SqliteFixture::new();
    seed(&fx);
    scenario(&Db {
        url: format!("sqlite://{}", fx.path),
        schema: None,
    });
}

#[test]
fn postgres_hostile_values_are_escaped_one_record_per_line() {
    let Some(fx) = PgFixture::new() else { return };
    seed(&fx);
    scenario(&Db {
        url: fx.url().to_owned(),
        schema: Some(fx.schema.clone()),
    });
}
