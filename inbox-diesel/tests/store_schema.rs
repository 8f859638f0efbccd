//! The claim key and the unique index must agree, checked against the live catalog;
//! a conflict the lookup cannot explain stops the group instead of being acked.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use diesel::connection::SimpleConnection;
use inbox_core::{Decision, InProcessTransport, InboxStore};
use inbox_diesel::{ClaimStatus, Error, SchemaProblem, Store};
use inbox_test_support::{group, usage, Fixture, PgFixture, Recorder, SqliteFixture, TestConn};

const GROUP: &str = "billing.daily-usage";

/// A sabotage of the claim table and the fragment the error must name.
struct Sabotage {
    name: &'static str,
    postgres: &'static str,
    sqlite: &'static str,
    found: &'static str,
    problem: SchemaProblem,
}

/// SQLite cannot drop a primary key: its sabotages rebuild the table.
const SQLITE_TABLE: &str = "DROP TABLE inbox_claims; CREATE TABLE inbox_claims (
    consumer_group TEXT NOT NULL, message_key TEXT NOT NULL, message_type TEXT NOT NULL,
    tenant TEXT, payload_digest BLOB NOT NULL, status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, starts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT, last_error TEXT, payload BLOB,
    first_seen_at TEXT NOT NULL, updated_at TEXT NOT NULL);";

const SABOTAGES: &[Sabotage] = &[
    Sabotage {
        name: "unique (tenant, message_key)",
        postgres: "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
                   CREATE UNIQUE INDEX by_tenant ON inbox_claims (tenant, message_key);",
        sqlite: "CREATE UNIQUE INDEX by_tenant ON inbox_claims (tenant, message_key);",
        found: "found unique (tenant, message_key) [by_tenant]",
        problem: SchemaProblem::NoClaimIndex,
    },
    Sabotage {
        name: "unique (message_key) alone",
        postgres: "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
                   CREATE UNIQUE INDEX by_key ON inbox_claims (message_key);",
        sqlite: "CREATE UNIQUE INDEX by_key ON inbox_claims (message_key);",
        found: "found unique (message_key) [by_key]",
        problem: SchemaProblem::NoClaimIndex,
    },
    Sabotage {
        name: "partial unique (consumer_group, message_key)",
        postgres: "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
                   CREATE UNIQUE INDEX live ON inbox_claims (consumer_group, message_key)
                   WHERE status <> 'dead';",
        sqlite: "CREATE UNIQUE INDEX live ON inbox_claims (consumer_group, message_key)
                 WHERE status <> 'dead';",
        found: "found partial unique (consumer_group, message_key) [live]",
        problem: SchemaProblem::NoClaimIndex,
    },
    Sabotage {
        // ON CONFLICT (consumer_group, message_key) has no arbiter on a wider index.
        name: "unique (consumer_group, message_key, tenant) alone",
        postgres: "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
                   CREATE UNIQUE INDEX wide ON inbox_claims (consumer_group, message_key, tenant);",
        sqlite: "CREATE UNIQUE INDEX wide ON inbox_claims (consumer_group, message_key, tenant);",
        found: "found unique (consumer_group, message_key, tenant) [wide]",
        problem: SchemaProblem::NoClaimIndex,
    },
    Sabotage {
        name: "nullable key column",
        postgres: "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
                   ALTER TABLE inbox_claims ALTER COLUMN consumer_group DROP NOT NULL;
                   CREATE UNIQUE INDEX claim ON inbox_claims (consumer_group, message_key);",
        sqlite: "DROP TABLE inbox_claims; CREATE TABLE inbox_claims (
                   consumer_group TEXT, message_key TEXT NOT NULL, message_type TEXT NOT NULL,
                   tenant TEXT, payload_digest BLOB NOT NULL, status TEXT NOT NULL,
                   attempts INTEGER NOT NULL DEFAULT 0, starts INTEGER NOT NULL DEFAULT 0,
                   next_attempt_at TEXT, last_error TEXT, payload BLOB,
                   first_seen_at TEXT NOT NULL, updated_at TEXT NOT NULL);
                 CREATE UNIQUE INDEX claim ON inbox_claims (consumer_group, message_key);",
        found: "expected NOT NULL column consumer_group comparing bytes, \
                found nullable column consumer_group",
        problem: SchemaProblem::NullableColumn,
    },
    Sabotage {
        name: "no unique index",
        postgres: "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;",
        sqlite: "",
        found: "found no unique index",
        problem: SchemaProblem::NoClaimIndex,
    },
    Sabotage {
        name: "primary key plus unique (message_key)",
        postgres: "CREATE UNIQUE INDEX also_key ON inbox_claims (message_key);",
        sqlite: "CREATE UNIQUE INDEX also_key ON inbox_claims (message_key);",
        found: "found unique (message_key) [also_key]",
        problem: SchemaProblem::ExtraUniqueIndex,
    },
    Sabotage {
        name: "expression index",
        postgres: "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
                   CREATE UNIQUE INDEX lowered ON inbox_claims (consumer_group, lower(message_key));",
        sqlite: "CREATE UNIQUE INDEX lowered ON inbox_claims (consumer_group, lower(message_key));",
        found: "found unique (consumer_group, <expression>) [lowered]",
        problem: SchemaProblem::NoClaimIndex,
    },
    Sabotage {
        name: "case-insensitive collation",
        postgres: "CREATE COLLATION folded_case
                       (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
                   ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
                   CREATE UNIQUE INDEX folded ON inbox_claims
                       (consumer_group, message_key COLLATE folded_case);",
        sqlite: "CREATE UNIQUE INDEX folded ON inbox_claims
                     (consumer_group, message_key COLLATE NOCASE);",
        found: "found unique (consumer_group, message_key collate ",
        problem: SchemaProblem::NoClaimIndex,
    },
    Sabotage {
        name: "primary key plus a case-insensitive unique index",
        postgres: "CREATE COLLATION folded_case
                       (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
                   CREATE UNIQUE INDEX folded ON inbox_claims
                       (consumer_group, message_key COLLATE folded_case);",
        sqlite: "CREATE UNIQUE INDEX folded ON inbox_claims
                     (consumer_group, message_key COLLATE NOCASE);",
        found: "found unique (consumer_group, message_key collate ",
        problem: SchemaProblem::ExtraUniqueIndex,
    },
];

fn refuses_each_sabotage<F: Fixture>(new: impl Fn() -> F, sql: impl Fn(&Sabotage) -> String) {
    for sabotage in SABOTAGES {
        let fx = new();
        // Migrate, then break the table behind the store's back.
        let store = fx.builder().build().expect("shipped schema is accepted");
        fx.execute(&sql(sabotage));
        let err = store.verify_schema().expect_err(sabotage.name);
        let msg = err.to_string();
        assert!(
            matches!(err, Error::SchemaMismatch { problem, .. } if problem == sabotage.problem),
            "{}: expected {:?}, got {msg}",
            sabotage.name,
            sabotage.problem
        );
        assert!(msg.contains(sabotage.found), "{}: {msg}", sabotage.name);
        if !sabotage.found.starts_with("expected") {
            assert!(
                msg.contains("expected unique (consumer_group, message_key)")
                    || msg.contains(
                        "expected no unique index other than on (consumer_group, message_key)"
                    ),
                "{}: {msg}",
                sabotage.name
            );
        }
        // A store built the normal way refuses to start on it.
        assert!(fx.builder().build().is_err(), "{}", sabotage.name);
    }
}

#[test]
fn postgres_refuses_sabotaged_claim_indexes() {
    if inbox_test_support::postgres_url().is_none() {
        return;
    }
    refuses_each_sabotage(
        || PgFixture::new().expect("postgres"),
        |s| s.postgres.to_owned(),
    );
}

#[test]
fn sqlite_refuses_sabotaged_claim_indexes() {
    refuses_each_sabotage(SqliteFixture::new, |s| match s.name {
        // The shipped table's primary key is the claim key: rebuild it first.
        "unique (tenant, message_key)"
        | "unique (message_key) alone"
        | "unique (consumer_group, message_key, tenant) alone"
        | "partial unique (consumer_group, message_key)"
        | "no unique index"
        | "expression index"
        | "case-insensitive collation" => format!("{SQLITE_TABLE}{}", s.sqlite),
        _ => s.sqlite.to_owned(),
    });
}

/// The lookup by key compares under the column's collation: a case-folding column
/// behind a byte-wise index would find a row the insert did not conflict with.
#[test]
fn postgres_refuses_a_case_folding_key_column() {
    let Some(fx) = PgFixture::new() else { return };
    let store = fx.builder().build().expect("store");
    fx.execute(
        "CREATE COLLATION folded_case
             (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
         ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
         ALTER TABLE inbox_claims ALTER COLUMN message_key TYPE TEXT COLLATE folded_case;
         CREATE UNIQUE INDEX bytes ON inbox_claims (consumer_group, message_key COLLATE \"C\");",
    );
    let msg = store.verify_schema().expect_err("refused").to_string();
    assert!(
        msg.contains(
            "expected NOT NULL column message_key comparing bytes, \
             found column message_key collate folded_case"
        ),
        "{msg}"
    );
}

/// The refusal `verify_schema` gave, with its message.
fn refusal<C: inbox_diesel::StoreConnection>(store: &Store<C>) -> (SchemaProblem, String) {
    match store.verify_schema() {
        Err(err @ Error::SchemaMismatch { problem, .. }) => (problem, err.to_string()),
        other => panic!("expected a schema mismatch, got {other:?}"),
    }
}

/// SQLite: the lookup compares under the column's declared collation, which a
/// byte-wise index naming its own collation does not show.
#[test]
fn sqlite_refuses_a_case_folding_key_column() {
    let fx = SqliteFixture::new();
    let store = fx.builder().build().expect("store");
    fx.execute(&format!(
        "{}CREATE UNIQUE INDEX bytes ON inbox_claims
             (consumer_group, message_key COLLATE BINARY);",
        SQLITE_TABLE.replace(
            "message_key TEXT NOT NULL,",
            "message_key TEXT NOT NULL COLLATE NOCASE,"
        )
    ));
    let (problem, msg) = refusal(&store);
    assert_eq!(problem, SchemaProblem::ColumnCollation, "{msg}");
    assert!(
        msg.contains(
            "expected NOT NULL column message_key comparing bytes, \
             found column message_key collate NOCASE"
        ),
        "{msg}"
    );
}

/// `ON CONFLICT` refuses a deferrable arbiter, initially deferred or immediate, even
/// beside a non-deferrable one: every claim would fail.
#[test]
fn postgres_refuses_a_deferrable_claim_key() {
    if inbox_test_support::postgres_url().is_none() {
        return;
    }
    for (name, sql, index) in [
        (
            "deferrable primary key, initially deferred",
            "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
             ALTER TABLE inbox_claims ADD CONSTRAINT inbox_claims_pkey
                 PRIMARY KEY (consumer_group, message_key) DEFERRABLE INITIALLY DEFERRED;",
            "(consumer_group, message_key) [inbox_claims_pkey]",
        ),
        (
            "deferrable primary key, initially immediate",
            "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
             ALTER TABLE inbox_claims ADD CONSTRAINT inbox_claims_pkey
                 PRIMARY KEY (consumer_group, message_key) DEFERRABLE INITIALLY IMMEDIATE;",
            "(consumer_group, message_key) [inbox_claims_pkey]",
        ),
        (
            "primary key plus a deferrable unique constraint on the key",
            "ALTER TABLE inbox_claims ADD CONSTRAINT also_key
                 UNIQUE (message_key, consumer_group) DEFERRABLE INITIALLY IMMEDIATE;",
            "(message_key, consumer_group) [also_key]",
        ),
    ] {
        let fx = PgFixture::new().expect("postgres");
        let store = fx.builder().build().expect("shipped schema is accepted");
        fx.execute(sql);
        let (problem, msg) = refusal(&store);
        assert_eq!(problem, SchemaProblem::DeferrableIndex, "{name}: {msg}");
        assert!(
            msg.contains(&format!(
                "expected non-deferrable unique (consumer_group, message_key), \
                 found deferrable unique {index}"
            )),
            "{name}: {msg}"
        );
        assert!(fx.builder().build().is_err(), "{name}");
        // Why: past the check, the claim statement itself fails.
        let unchecked = fx
            .builder()
            .handler(Recorder::new(GROUP))
            .build_unchecked()
            .unwrap();
        fx.connect().create_effects().unwrap();
        let outcome = unchecked.process_batch(&group(GROUP), &[usage("k", 1)]);
        assert!(
            matches!(outcome, Err(Error::Database(_))),
            "{name}: {outcome:?}"
        );
    }
}

/// A failed `CREATE UNIQUE INDEX CONCURRENTLY` leaves an index that is no arbiter.
#[test]
fn postgres_refuses_an_invalid_claim_index() {
    let Some(fx) = PgFixture::new() else { return };
    let store = fx.builder().build().expect("store");
    fx.execute(
        "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
         INSERT INTO inbox_claims (consumer_group, message_key, message_type, payload_digest,
                                   status, first_seen_at, updated_at)
         SELECT 'g', 'k', 't', '\\x00', 'done', now(), now() FROM generate_series(1, 2);",
    );
    let mut conn = fx.connect();
    let failed = conn.batch_execute(
        "CREATE UNIQUE INDEX CONCURRENTLY claim ON inbox_claims (consumer_group, message_key)",
    );
    assert!(failed.is_err(), "the duplicate makes the build fail");
    fx.execute("DELETE FROM inbox_claims;");
    let (problem, msg) = refusal(&store);
    assert_eq!(problem, SchemaProblem::InvalidIndex, "{msg}");
    assert!(
        msg.contains(
            "expected valid unique (consumer_group, message_key), \
             found invalid unique (consumer_group, message_key) [claim]"
        ),
        "{msg}"
    );
    assert!(fx.builder().build().is_err());
}

#[test]
fn postgres_schema_check_is_scoped_to_the_store_schema() {
    let (Some(broken), Some(fine)) = (PgFixture::new(), PgFixture::new()) else {
        return;
    };
    let broken_store = broken.builder().build().expect("store");
    let fine_store = fine.builder().build().expect("store");
    broken.execute("ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;");
    assert!(broken_store.verify_schema().is_err());
    fine_store
        .verify_schema()
        .expect("another schema's sabotage does not leak");
    assert!(fine.builder().build().is_ok());
}

#[test]
fn shipped_schema_is_accepted_on_both_backends() {
    let sqlite = SqliteFixture::new();
    sqlite
        .builder()
        .build()
        .expect("sqlite")
        .verify_schema()
        .expect("sqlite schema");
    if let Some(pg) = PgFixture::new() {
        pg.builder()
            .build()
            .expect("postgres")
            .verify_schema()
            .expect("postgres schema");
    }
}

/// A trigger swallows the claim insert: the index "rejected" it, yet the lookup by the
/// same claim key finds nothing. That must stop the group, never be acked.
fn phantom_insert_stops_the_group<F: Fixture>(fx: &F, swallow_inserts: &str) {
    let handler = Recorder::new(GROUP);
    let calls = handler.calls();
    let store = fx.open(fx.builder().handler(handler));
    fx.execute(swallow_inserts);

    let g = group(GROUP);
    let (decisions, metrics) = inbox_test_support::metrics::capture(|| {
        store.process_batch(&g, &[usage("ghost", 1)]).unwrap()
    });
    let [Decision::Stop(violation)] = &decisions[..] else {
        panic!("expected a stop, got {decisions:?}");
    };
    assert_eq!(
        metrics.counter("inbox_phantom_conflicts_total", &[("group", GROUP)]),
        1
    );
    assert_eq!(violation.key.as_str(), "ghost");
    assert!(
        violation.detail.contains("no row exists"),
        "{}",
        violation.detail
    );
    assert!(calls.lock().unwrap().is_empty(), "the handler must not run");

    // Through a transport: the group halts with the error, nothing counts as a duplicate.
    let mut transport = InProcessTransport::new(store.clone());
    transport.publish(usage("ghost-2", 1)).unwrap();
    let err = transport.run_until_idle().expect_err("the group stops");
    assert!(
        matches!(err, inbox_core::Error::ClaimInvariantViolated(_)),
        "{err}"
    );
    assert_eq!(transport.stats().duplicates, 0);
    assert_eq!(transport.stats().processed, 0);
    assert_eq!(transport.pending(), 1, "the delivery stays queued");
    assert!(calls.lock().unwrap().is_empty());
}

/// A trigger swallows the failure update: the failure must not vanish as "terminal".
fn phantom_failure_update_stops_the_group<F: Fixture>(fx: &F, swallow_updates: &str) {
    let handler = Recorder::new(GROUP).behaviour(|_, _| inbox_test_support::Outcome::ApplyThenFail);
    let store = fx.open(fx.builder().handler(handler));
    fx.execute(swallow_updates);
    let decisions = store
        .process_batch(&group(GROUP), &[usage("lost", 1)])
        .unwrap();
    let [Decision::Stop(violation)] = &decisions[..] else {
        panic!("expected a stop, got {decisions:?}");
    };
    assert!(
        violation.detail.contains("failure update"),
        "{}",
        violation.detail
    );
    assert_eq!(fx.connect().effects_of("lost").unwrap(), 0);
    assert!(store.dead_letters(&group(GROUP)).unwrap().is_empty());
}

const PG_SWALLOW: &str = "CREATE FUNCTION swallow() RETURNS trigger LANGUAGE plpgsql AS
    $$ BEGIN RETURN NULL; END $$;";

#[test]
fn postgres_phantom_insert_stops_the_group() {
    let Some(fx) = PgFixture::new() else { return };
    phantom_insert_stops_the_group(
        &fx,
        &format!("{PG_SWALLOW} CREATE TRIGGER swallow BEFORE INSERT ON inbox_claims FOR EACH ROW EXECUTE FUNCTION swallow();"),
    );
}

#[test]
fn sqlite_phantom_insert_stops_the_group() {
    phantom_insert_stops_the_group(
        &SqliteFixture::new(),
        "CREATE TRIGGER swallow BEFORE INSERT ON inbox_claims BEGIN SELECT RAISE(IGNORE); END;",
    );
}

#[test]
fn postgres_phantom_failure_update_stops_the_group() {
    let Some(fx) = PgFixture::new() else { return };
    phantom_failure_update_stops_the_group(
        &fx,
        &format!("{PG_SWALLOW} CREATE TRIGGER swallow BEFORE UPDATE ON inbox_claims FOR EACH ROW WHEN (NEW.status <> 'done') EXECUTE FUNCTION swallow();"),
    );
}

#[test]
fn sqlite_phantom_failure_update_stops_the_group() {
    phantom_failure_update_stops_the_group(
        &SqliteFixture::new(),
        "CREATE TRIGGER swallow BEFORE UPDATE ON inbox_claims WHEN NEW.status <> 'done'
         BEGIN SELECT RAISE(IGNORE); END;",
    );
}

#[test]
fn an_unchecked_store_still_stops_on_a_sabotaged_index() {
    // With the PK replaced by a unique index on message_key alone, and verification
    // bypassed by the explicitly named unchecked constructor, a second group's claim
    // cannot be inserted: the store must fail loudly, never ack it as a duplicate.
    let Some(fx) = PgFixture::new() else { return };
    fx.builder().build().expect("migrate");
    fx.execute(
        "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
         CREATE UNIQUE INDEX by_key ON inbox_claims (message_key);
         CREATE UNIQUE INDEX claim ON inbox_claims (consumer_group, message_key);",
    );
    let first = fx
        .builder()
        .handler(Recorder::new("group.one"))
        .build_unchecked()
        .unwrap();
    let second_handler = Recorder::new("group.two");
    let second_calls = second_handler.calls();
    let second = fx
        .builder()
        .handler(second_handler)
        .build_unchecked()
        .unwrap();
    fx.connect().create_effects().unwrap();
    assert_eq!(
        first
            .process_batch(&group("group.one"), &[usage("k", 1)])
            .unwrap(),
        [Decision::Processed]
    );
    let outcome = second.process_batch(&group("group.two"), &[usage("k", 1)]);
    assert!(
        !matches!(outcome.as_deref(), Ok([Decision::Duplicate])),
        "a claim the index rejected was acked as a duplicate: {outcome:?}"
    );
    assert!(outcome.is_err(), "{outcome:?}");
    assert!(second_calls.lock().unwrap().is_empty());
    assert!(
        fx.builder().build().is_err(),
        "the checked constructor refuses this schema"
    );
}

#[test]
fn connect_errors_keep_the_driver_error_and_hide_the_password() {
    let err = Store::<diesel::PgConnection>::builder("postgres://app:s3cret@127.0.0.1:1/billing")
        .build()
        .expect_err("nothing listens on port 1");
    let msg = err.to_string();
    assert!(
        msg.starts_with("could not connect to postgres://app:***@127.0.0.1:1/billing: "),
        "{msg}"
    );
    assert!(msg.to_lowercase().contains("connection refused"), "{msg}");
    assert!(!msg.contains("s3cret"), "{msg}");
    assert!(!format!("{err:?}").contains("s3cret"));

    let err = Store::<diesel::PgConnection>::builder("postgres://127.0.0.1/test")
        .schema("Bad-Name")
        .build()
        .expect_err("schema name");
    assert!(err.to_string().contains("invalid schema name"), "{err}");
}

#[test]
fn claim_status_round_trips() {
    let fx = SqliteFixture::new();
    let store = fx.open(fx.builder().handler(Recorder::new(GROUP)));
    store
        .process_batch(&group(GROUP), &[usage("k", 1)])
        .unwrap();
    let routes = store.routes();
    assert_eq!(routes, [(group(GROUP), "usage.recorded".to_owned())]);
    let claim = store
        .claim(&inbox_core::ClaimKey::new(
            group(GROUP),
            inbox_core::MessageKey::new("k").unwrap(),
        ))
        .unwrap()
        .unwrap();
    assert_eq!(claim.status, ClaimStatus::Done);
}

/// A migration in progress in one schema (here held up by a lock on its migrations
/// table) never holds up a store of another schema of the same database: the
/// migration lock is per schema. With one lock per database, the second build waited
/// for the first and failed on its 100 ms `lock_timeout`.
#[test]
fn postgres_a_migration_in_one_schema_never_waits_for_another_schema() {
    let Some(busy) = PgFixture::new() else { return };
    let Some(other) = PgFixture::new() else {
        return;
    };
    drop(busy.builder().build().unwrap());
    let mut holder = busy.connect();
    holder
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE \"{}\".__diesel_schema_migrations IN ACCESS EXCLUSIVE MODE",
            busy.schema
        ))
        .unwrap();
    let held_up = {
        let builder = busy.builder();
        std::thread::spawn(move || builder.build().map(drop))
    };
    // Give the held-up build time to take its migration lock.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let url = format!("{}?options=-c%20lock_timeout%3D100", other.url());
    let built = Store::<diesel::PgConnection>::builder(url)
        .schema(other.schema.clone())
        .build();
    holder.batch_execute("ROLLBACK").unwrap();
    assert!(held_up.join().unwrap().is_ok());
    if let Err(err) = built {
        panic!("a store of another schema waited for a migration: {err}");
    }
}
