//! The real `inbox` binary against a real database (SQLite, and PostgreSQL when
//! configured): human tables, JSON documents, exit codes, no password printed.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::{Command, Output};

use inbox_core::{DeadLetterReason, Decision};
use inbox_test_support::{group, usage, Fixture, Outcome, PgFixture, Recorder, SqliteFixture};
use serde_json::Value;

const GROUP: &str = "billing.daily-usage";

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

fn code(o: &Output) -> i32 {
    o.status.code().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// Two `max_attempts` letters, one `key_collision` letter, one done claim.
fn seed<F: Fixture>(fx: &F) {
    let store = fx
        .builder()
        .handler(
            Recorder::new(GROUP)
                .policy(
                    inbox_core::RetryPolicy::new(
                        1,
                        std::time::Duration::from_millis(1),
                        std::time::Duration::from_millis(1),
                    )
                    .unwrap(),
                )
                .behaviour(|key, _| {
                    if key.starts_with("bad-") {
                        Outcome::FailWith(format!("row {} locked", key.len()))
                    } else {
                        Outcome::Apply
                    }
                }),
        )
        .build()
        .unwrap();
    inbox_test_support::TestConn::create_effects(&mut *store.connection().unwrap()).unwrap();
    let g = group(GROUP);
    for key in ["bad-1", "bad-22"] {
        assert_eq!(
            store.process_batch(&g, &[usage(key, 1)]).unwrap(),
            [Decision::DeadLettered(DeadLetterReason::MaxAttempts)]
        );
    }
    assert_eq!(
        store.process_batch(&g, &[usage("ok-1", 1)]).unwrap(),
        [Decision::Processed]
    );
    assert_eq!(
        store.process_batch(&g, &[usage("ok-1", 2)]).unwrap(),
        [Decision::DeadLettered(DeadLetterReason::KeyCollision)]
    );
    // A consumer halted another group (as it records a `Stop`).
    inbox_core::GroupHalts::record_halt(
        &store,
        &inbox_core::ClaimInvariantViolated {
            group: group(HALTED),
            key: inbox_core::MessageKey::new("k-9").unwrap(),
            detail: "insert conflicted but no row exists".to_owned(),
        },
    )
    .unwrap();
}

/// The group [`seed`] leaves halted.
const HALTED: &str = "billing.audit";

/// `groups list`, `groups resume` and the halted groups in `stats`.
fn halted_groups(db: &Db) {
    let list = inbox(db, &["groups", "list"]);
    assert_eq!(code(&list), 0, "{}", stderr(&list));
    let text = stdout(&list);
    assert!(text.starts_with("HALTED_GROUP "), "{text}");
    assert!(
        text.contains("billing.audit") && text.contains("k-9"),
        "{text}"
    );
    assert!(text.trim_end().ends_with("1 halted groups"), "{text}");
    let list = json(&inbox(db, &["--json", "groups", "list"]));
    let halted = list["halted"].as_array().unwrap();
    assert_eq!(halted.len(), 1, "{list}");
    assert_eq!(halted[0]["consumer_group"], HALTED);
    assert_eq!(halted[0]["message_key"], "k-9");
    assert_eq!(halted[0]["detail"], "insert conflicted but no row exists");
    assert!(halted[0]["halted_at"].is_string(), "{list}");
    let stats = json(&inbox(db, &["--json", "stats"]));
    assert_eq!(stats["halted"], list["halted"]);
    let stats = stdout(&inbox(db, &["stats"]));
    assert!(stats.contains("halted groups\nHALTED_GROUP"), "{stats}");

    let resume = inbox(db, &["groups", "resume", HALTED]);
    assert_eq!(code(&resume), 0, "{}", stderr(&resume));
    assert_eq!(
        stdout(&resume),
        "resumed consumer group billing.audit: its consumers resume at their next halt poll\n"
    );
    let again = inbox(db, &["groups", "resume", HALTED]);
    assert_eq!(code(&again), 4);
    assert_eq!(stdout(&again), "");
    assert_eq!(
        stderr(&again),
        "inbox: consumer group billing.audit is not halted\n"
    );
    let again = inbox(db, &["--json", "groups", "resume", HALTED]);
    assert_eq!(code(&again), 4);
    assert_eq!(
        json(&again),
        serde_json::json!({ "consumer_group": HALTED, "resumed": false })
    );
    let bad = inbox(db, &["groups", "resume", "Billing Audit"]);
    assert_eq!(code(&bad), 2);
    assert!(
        stderr(&bad).contains("invalid consumer group"),
        "{}",
        stderr(&bad)
    );
    let none = inbox(db, &["groups", "list"]);
    assert_eq!(stdout(&none), "(none)\n0 halted groups\n");
    let stats = stdout(&inbox(db, &["stats"]));
    assert!(!stats.contains("halted groups"), "{stats}");
}

fn scenario(db: &Db) {
    halted_groups(db);
    // Human list: a header, the rows, a summary.
    let list = inbox(db, &["dead-letters", "list"]);
    assert_eq!(code(&list), 0, "{}", stderr(&list));
    let text = stdout(&list);
    assert!(text.starts_with("ID "), "{text}");
    assert!(
        text.contains("bad-22") && text.contains("key_collision"),
        "{text}"
    );
    assert!(text.trim_end().ends_with("3 dead letters"), "{text}");

    // JSON list, newest first, with the documented fields.
    let list = json(&inbox(
        db,
        &["--json", "dead-letters", "list", "--reason", "max_attempts"],
    ));
    let letters = list["dead_letters"].as_array().unwrap();
    assert_eq!(letters.len(), 2);
    assert_eq!(letters[0]["message_key"], "bad-22");
    for field in [
        "id",
        "consumer_group",
        "message_key",
        "message_type",
        "tenant",
        "reason",
        "attempts",
        "last_error",
        "dead_lettered_at",
        "replay_count",
        "replayed_at",
        "discarded_at",
        "failure_group",
        "status",
        "delivered_by_replay",
    ] {
        assert!(letters[0].get(field).is_some(), "{field}: {}", letters[0]);
    }
    assert_eq!(letters[0]["status"], "pending");
    let first_id = letters[1]["id"].as_i64().unwrap();

    // Failure groups: the two max_attempts letters are one group.
    let groups = json(&inbox(db, &["--json", "dead-letters", "groups"]));
    let groups = groups["failure_groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert_eq!(groups[0]["count"], 2);
    assert_eq!(groups[0]["signature"], "row <n> locked");
    assert_eq!(groups[0]["consumer_groups"][0], GROUP);
    assert_eq!(groups[0]["replayable"], true);
    // The newest letter's error, unmasked.
    assert_eq!(groups[0]["sample_error"], "row 6 locked");
    let fingerprint = groups[0]["fingerprint"].as_str().unwrap().to_owned();
    let human = stdout(&inbox(db, &["dead-letters", "groups"]));
    assert!(
        human.starts_with("FAILURE_GROUP") && human.contains(&fingerprint),
        "{human}"
    );

    // Show: human and JSON.
    let show = inbox(db, &["dead-letters", "show", &first_id.to_string()]);
    assert_eq!(code(&show), 0);
    let text = stdout(&show);
    assert!(
        text.contains("bad-1") && text.contains(r#"{"amount":1}"#),
        "{text}"
    );
    let show = json(&inbox(
        db,
        &["--json", "dead-letters", "show", &first_id.to_string()],
    ));
    assert_eq!(show["payload"], r#"{"amount":1}"#);
    assert_eq!(show["claim_status"], "dead");
    assert_eq!(show["replayable"], true);
    assert!(show["headers"].is_object());

    // Not found: exit 4, a JSON error on stdout with --json.
    let missing = inbox(db, &["--json", "dead-letters", "show", "999999"]);
    assert_eq!(code(&missing), 4);
    assert_eq!(json(&missing)["exit_code"], 4);
    assert!(stderr(&missing).contains("no dead letter 999999"));

    // A bulk replay needs --yes: exit 2, nothing changed.
    let refused = inbox(db, &["dead-letters", "replay", "--group", &fingerprint]);
    assert_eq!(code(&refused), 2);
    assert!(stderr(&refused).contains("refusing to replay 2 dead letters without --yes"));
    let still = json(&inbox(
        db,
        &["--json", "dead-letters", "list", "--status", "pending"],
    ));
    assert_eq!(still["dead_letters"].as_array().unwrap().len(), 3);

    // The collision letter is refused: exit 5, with the advice.
    let collision = json(&inbox(
        db,
        &[
            "--json",
            "dead-letters",
            "list",
            "--reason",
            "key_collision",
        ],
    ));
    let collision_id = collision["dead_letters"][0]["id"]
        .as_i64()
        .unwrap()
        .to_string();
    let refused = inbox(db, &["--json", "dead-letters", "replay", &collision_id]);
    assert_eq!(code(&refused), 5, "{}", stdout(&refused));
    assert_eq!(json(&refused)["outcome"], "refused");

    // Replay by failure group: the count; again: nothing.
    let replay = inbox(
        db,
        &[
            "--json",
            "dead-letters",
            "replay",
            "--group",
            &fingerprint,
            "--yes",
        ],
    );
    assert_eq!(code(&replay), 0, "{}", stderr(&replay));
    let report = json(&replay);
    assert_eq!(
        (report["matched"].as_u64(), report["replayed"].as_u64()),
        (Some(2), Some(2))
    );
    let again = inbox(
        db,
        &[
            "dead-letters",
            "replay",
            "--group",
            &fingerprint,
            "--status",
            "replayed",
            "--yes",
        ],
    );
    assert_eq!(code(&again), 0);
    assert!(
        stdout(&again).starts_with("replayed 0 of 2 dead letters"),
        "{}",
        stdout(&again)
    );
    let one = json(&inbox(
        db,
        &["--json", "dead-letters", "replay", &first_id.to_string()],
    ));
    assert_eq!(one["outcome"], "claim_not_dead");
    assert_eq!(one["claim_status"], "failed");

    // Claims of a key.
    let claims = json(&inbox(db, &["--json", "claims", "show", "bad-1"]));
    assert_eq!(claims["claims"][0]["status"], "failed");
    assert_eq!(claims["claims"][0]["attempts"], 0);
    assert_eq!(code(&inbox(db, &["claims", "show", "no-such-key"])), 4);

    // Stats: the replays wait in the outbox.
    let stats = json(&inbox(db, &["--json", "stats"]));
    assert_eq!(stats["outbox"]["backlog"], 2);
    assert_eq!(stats["groups"][0]["consumer_group"], GROUP);
    assert_eq!(stats["groups"][0]["failed"], 2);
    assert_eq!(stats["groups"][0]["done"], 1);
    assert_eq!(stats["dead_letters"][0]["reason"], "key_collision");
    // The activity: one done claim and three dead letters, all within the hour.
    let activity = &stats["activity"];
    assert_eq!(activity["interval_secs"], 3600);
    assert_eq!(
        activity["groups"].as_array().unwrap().len(),
        1,
        "{activity}"
    );
    let g = &activity["groups"][0];
    assert_eq!(g["consumer_group"], GROUP);
    assert_eq!(g["buckets"].as_array().unwrap().len(), 24);
    assert_eq!(g["buckets"][23]["processed"]["count"], 1);
    assert_eq!(g["processed_last_hour"]["count"], 1);
    assert_eq!(g["processed_last_hour"]["at_least"], false);
    assert_eq!(g["dead_lettered_last_day"]["count"], 3);
    let human = stdout(&inbox(db, &["stats"]));
    assert!(human.contains("outbox: 2 unpublished"), "{human}");
    assert!(
        human.contains(&format!(
            "activity (last hour / last day)\n{GROUP}: processed 1 / 1, dead-lettered 3 / 3\n"
        )),
        "{human}"
    );

    // Discard, bulk with a limit.
    let discard = json(&inbox(
        db,
        &[
            "--json",
            "dead-letters",
            "discard",
            "--status",
            "replayed",
            "--limit",
            "1",
            "--yes",
        ],
    ));
    assert_eq!(discard["discarded"], 1);
    let purge = json(&inbox(
        db,
        &["--json", "purge", "--discarded", "0s", "--dry-run"],
    ));
    assert_eq!(purge["dry_run"], true);
    assert_eq!(purge["discarded_dead_letters"], 1);
    let purge = json(&inbox(
        db,
        &["--json", "purge", "--discarded", "0s", "--batch", "1"],
    ));
    assert_eq!(purge["discarded_dead_letters"], 1);
    assert_eq!(
        code(&inbox(
            db,
            &["purge", "--done-claims", "1m", "--longest-retry", "10m"]
        )),
        2
    );

    // Verify.
    let verify = inbox(db, &["verify"]);
    assert_eq!(code(&verify), 0, "{}", stderr(&verify));
    // The test server runs without a standby.
    let replication = if db.url.starts_with("sqlite:") {
        "replication: skipped (SQLite)\n"
    } else {
        "replication: none (no standby connected)\n"
    };
    assert_eq!(
        stdout(&verify),
        format!("schema: ok\n{replication}topology: skipped (no AMQP_URL)\n")
    );
    let verify = json(&inbox(db, &["--json", "verify"]));
    let mode = if db.url.starts_with("sqlite:") {
        "skipped"
    } else {
        "none"
    };
    assert_eq!(verify["replication"], mode);
    assert_eq!(verify["replication_warnings"], serde_json::json!([]));
    // Bad arguments.
    assert_eq!(
        code(&inbox(
            db,
            &["dead-letters", "list", "--since", "yesterday"]
        )),
        2
    );
    assert_eq!(code(&inbox(db, &["dead-letters", "nonsense"])), 2);
    // A reason no letter can have is refused, with the reasons there are.
    let bogus = inbox(db, &["dead-letters", "list", "--reason", "max-attempts"]);
    assert_eq!(code(&bogus), 2);
    assert!(
        stderr(&bogus).contains("expected one of max_attempts, permanent"),
        "{}",
        stderr(&bogus)
    );
}

#[test]
fn sqlite_session() {
    let fx = SqliteFixture::new();
    seed(&fx);
    let db = Db {
        url: format!("sqlite://{}", fx.path),
        schema: None,
    };
    scenario(&db);
    // A schema the store cannot work with: exit 3, for verify and every other command.
    fx.execute("DROP INDEX inbox_dead_letters_recent; DROP INDEX inbox_dead_letters_discarded; ALTER TABLE inbox_dead_letters DROP COLUMN discarded_at");
    let verify = inbox(&db, &["--json", "verify"]);
    assert_eq!(code(&verify), 3);
    assert_eq!(json(&verify)["schema"], "error");
    assert_eq!(code(&inbox(&db, &["stats"])), 3);
}

/// `rebuild-reports`: the stored reports (written here as a rebuilder records them),
/// newest first, by projection, limited; JSON and a table.
fn rebuild_reports_are_listed<F: Fixture>(fx: &F, db: &Db) {
    drop(fx.builder().build().unwrap());
    for (projection, kind, outcome, error) in [
        ("daily_usage", "audit", "ok", "NULL"),
        (
            "daily_usage",
            "rebuild",
            "failed",
            "'rebuild hook of daily_usage failed'",
        ),
        ("monthly_usage", "rebuild", "ok", "NULL"),
    ] {
        fx.execute(&format!(
            "INSERT INTO inbox_rebuild_reports (projection, kind, started_at, finished_at, \
             outcome, error, partitions, rows_checked, rows_differing, rows_changed, \
             extra_rows, events_covered, claims_recorded, claims_converted, \
             dead_letters_resolved, largest_ratio, lock_waits, lock_timeouts, duration_ms, \
             drift_sample) VALUES ('{projection}', '{kind}', '2026-03-01 12:00:00+00:00', \
             '2026-03-01 12:00:01+00:00', '{outcome}', {error}, 2, 13, 3, 0, 1, 0, 0, 0, 0, \
             2.4, 0, 0, 1000, '[{{\"partition\":\"2026-03-01\",\"row\":\"1\",\"projected\":24.0,\"recomputed\":10.0}}]')"
        ));
    }
    let all = json(&inbox(db, &["--json", "rebuild-reports"]));
    let all = all["rebuild_reports"].as_array().unwrap();
    assert_eq!(all.len(), 3);
    assert_eq!(all[0]["projection"], "monthly_usage");
    let failed = &all[1];
    assert_eq!(failed["kind"], "rebuild");
    assert_eq!(failed["outcome"], "failed");
    assert_eq!(failed["error"], "rebuild hook of daily_usage failed");
    for field in [
        "id",
        "projection",
        "kind",
        "started_at",
        "finished_at",
        "outcome",
        "error",
        "partitions",
        "rows_checked",
        "rows_differing",
        "rows_changed",
        "extra_rows",
        "events_covered",
        "claims_recorded",
        "claims_converted",
        "dead_letters_resolved",
        "largest_ratio",
        "lock_waits",
        "lock_timeouts",
        "duration_ms",
        "drift_sample",
    ] {
        assert!(failed.get(field).is_some(), "{field}: {failed}");
    }
    assert_eq!(failed["rows_checked"], 13);
    assert_eq!(failed["largest_ratio"], 2.4);
    assert_eq!(failed["drift_sample"][0]["recomputed"], 10.0);
    let one = json(&inbox(
        db,
        &[
            "--json",
            "rebuild-reports",
            "--projection",
            "daily_usage",
            "--limit",
            "1",
        ],
    ));
    let one = one["rebuild_reports"].as_array().unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0]["outcome"], "failed");
    let human = inbox(db, &["rebuild-reports", "--projection", "daily_usage"]);
    assert_eq!(code(&human), 0);
    let human = stdout(&human);
    assert!(human.starts_with("ID"), "{human}");
    assert!(
        human.contains("rebuild hook of daily_usage failed"),
        "{human}"
    );
    assert!(human.ends_with("2 reports\n"), "{human}");
}

#[test]
fn sqlite_rebuild_reports() {
    let fx = SqliteFixture::new();
    let db = Db {
        url: format!("sqlite://{}", fx.path),
        schema: None,
    };
    rebuild_reports_are_listed(&fx, &db);
}

#[test]
fn postgres_rebuild_reports() {
    let Some(fx) = PgFixture::new() else { return };
    let db = Db {
        url: fx.url().to_owned(),
        schema: Some(fx.schema.clone()),
    };
    rebuild_reports_are_listed(&fx, &db);
}

#[test]
fn postgres_session() {
    let Some(fx) = PgFixture::new() else { return };
    seed(&fx);
    let db = Db {
        url: fx.url().to_owned(),
        schema: Some(fx.schema.clone()),
    };
    scenario(&db);
}

#[test]
fn no_database_and_an_unreachable_one_say_so_without_the_password() {
    let none = Command::new(env!("CARGO_BIN_EXE_inbox"))
        .env_remove("DATABASE_URL")
        .args(["stats"])
        .output()
        .unwrap();
    assert_eq!(code(&none), 2);
    assert!(stderr(&none).contains("DATABASE_URL"));
    let db = Db {
        url: "postgres://operator:s3cret-pw@127.0.0.1:1/nowhere".to_owned(),
        schema: None,
    };
    for args in [&["stats"][..], &["--json", "verify"][..]] {
        let out = inbox(&db, args);
        assert_eq!(code(&out), 1, "{}", stderr(&out));
        assert!(
            stderr(&out).contains("could not connect"),
            "{}",
            stderr(&out)
        );
        for printed in [stdout(&out), stderr(&out)] {
            assert!(!printed.contains("s3cret-pw"), "{printed}");
        }
    }
}

/// `inbox` with `--database-url` as given, in `dir`, with no other configuration.
fn inbox_at(dir: &std::path::Path, url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_inbox"))
        .current_dir(dir)
        .env_remove("DATABASE_URL")
        .env_remove("INBOX_SCHEMA")
        .env_remove("AMQP_URL")
        .args(["--database-url", url])
        .args(args)
        .output()
        .unwrap()
}

fn files_in(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_value_that_is_no_database_url_is_a_usage_error_that_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for url in [
        "host=127.0.0.1 user=operator password=s3cret-pw dbname=billing",
        "postgress://operator:s3cret-pw@127.0.0.1/billing",
        "mysql://operator:s3cret-pw@127.0.0.1/billing",
        "billing s3cret-pw.db",
    ] {
        for args in [
            &["stats"][..],
            &["dead-letters", "list"],
            &["--json", "verify"],
        ] {
            let out = inbox_at(dir.path(), url, args);
            assert_eq!(code(&out), 2, "{url} {args:?}: {}", stderr(&out));
            let err = stderr(&out);
            assert!(
                err.contains("expected a postgres:// (or postgresql://) URL, or sqlite://PATH"),
                "{err}"
            );
            for printed in [stdout(&out), err] {
                assert!(!printed.contains("s3cret-pw"), "{printed}");
            }
        }
    }
    assert_eq!(
        files_in(dir.path()),
        Vec::<String>::new(),
        "a file was created"
    );
}

#[test]
fn a_missing_sqlite_file_is_never_created() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("billing.db");
    let url = format!("sqlite://{}", path.display());
    for args in [
        &["stats"][..],
        &["dead-letters", "list"],
        &["claims", "show", "k-1"],
        &["verify"],
        &["purge", "--dry-run"],
        &["dead-letters", "replay", "--yes"],
    ] {
        let out = inbox_at(dir.path(), &url, args);
        assert_eq!(code(&out), 1, "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("no SQLite database at"),
            "{}",
            stderr(&out)
        );
        assert!(!path.exists(), "{args:?} created {}", path.display());
    }
    assert_eq!(files_in(dir.path()), Vec::<String>::new());
}

#[test]
fn an_invalid_schema_is_a_usage_error() {
    let fx = SqliteFixture::new();
    drop(fx.builder().build().unwrap());
    let sqlite = format!("sqlite://{}", fx.path);
    let dir = tempfile::tempdir().unwrap();
    let pg = PgFixture::new();
    let mut cases = vec![(sqlite, "inbox")];
    if let Some(pg) = &pg {
        cases.push((pg.url().to_owned(), "Bad Schema; DROP"));
    }
    for (url, schema) in cases {
        let out = inbox_at(dir.path(), &url, &["--schema", schema, "stats"]);
        assert_eq!(code(&out), 2, "{url}: {}", stderr(&out));
        assert!(stderr(&out).contains("--schema"), "{}", stderr(&out));
    }
}

#[test]
fn debug_of_the_arguments_never_shows_a_password() {
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Ops {
        #[command(flatten)]
        inbox: inbox_cli::GlobalArgs,
        #[command(subcommand)]
        command: inbox_cli::Command,
    }

    for argv in [
        &[
            "ops",
            "--database-url",
            "postgres://op:s3cret-pw@db/x",
            "stats",
        ][..],
        &[
            "ops",
            "--database-url",
            "postgres://op@db/x?password=s3cret-pw",
            "verify",
            "--amqp-url",
            "amqp://guest:s3cret-pw@broker/%2f",
        ],
        &[
            "ops",
            "--database-url",
            "host=db password=s3cret-pw",
            "selftest",
            "--relay",
            "--amqp-url",
            "amqps://guest:s3cret-pw@broker/%2f",
        ],
        // The nodes of a cluster: every item's password hidden.
        &[
            "ops",
            "verify",
            "--amqp-url",
            "amqp://a:s3cret-pw@n1/%2f,amqp://b:s3cret-pw@n2/%2f amqp://c:s3cret-pw@n3/%2f",
        ],
    ] {
        let ops = Ops::try_parse_from(argv).unwrap();
        let printed = format!("{ops:?} {ops:#?}");
        assert!(!printed.contains("s3cret-pw"), "{printed}");
        assert!(printed.contains("***"), "{printed}");
    }
}
