//! A server whose messages are translated: the store recognises deadlocks and data
//! errors by their English message (diesel hands them over without SQLSTATE), so it
//! asks for `lc_messages = 'C'` on its connections, and says so where the role may
//! not.
//!
//! The server must have a German locale (`.ci/run` makes one); without it these tests
//! are skipped, each with a `skipped: <test>: this machine lacks the de_DE.UTF-8 locale
//! ...` line on the terminal, and fail under `INBOX_REQUIRE_SERVICES=1`.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::HashSet;
use std::sync::{Arc, Barrier, Mutex, Once};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::PgConnection;
use inbox_core::{ClaimKey, ConsumerGroup, Decision, Handler, HandlerError, MessageContext};
use inbox_diesel::{ClaimStatus, ErrorClass, Store, StoreBuilder};
use inbox_test_support::claim_key;
use inbox_test_support::{group, unique_name, usage, Fixture, PgFixture, TestConn, Usage};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

const GROUP: &str = "billing.daily-usage";
const GERMAN: &str = "de_DE.UTF-8";

fn key(k: &str) -> ClaimKey {
    claim_key(GROUP, k)
}

/// A schema of the test's own on a server that can answer in German, or `None` (the
/// test skips): when PostgreSQL is missing and `INBOX_SKIP_SERVICES=1`, or when the
/// server lacks the locale (said on the terminal). Under `INBOX_REQUIRE_SERVICES=1`
/// both fail instead.
fn translated_server() -> Option<PgFixture> {
    let fx = PgFixture::new()?;
    let mut conn = fx.connect();
    let german = conn
        .batch_execute(&format!("SET lc_messages = '{GERMAN}'"))
        .is_ok()
        && matches!(conn.batch_execute("SELECT 1/0"),
                    Err(err) if err.to_string().contains("Division durch Null"));
    if !german {
        inbox_test_support::services::machine_lacks(
            "the de_DE.UTF-8 locale",
            &format!("the PostgreSQL server cannot answer in German: it needs the {GERMAN} locale"),
            &format!(
                "add it with `localedef --no-archive -i de_DE -f UTF-8 {GERMAN}` (as .ci/run \
                 does; the server sees a locale directory without a restart)"
            ),
        );
        return None;
    }
    // The tables, made by the superuser: the tests' roles need not create them.
    drop(
        Store::<PgConnection>::builder(fx.url())
            .schema(fx.schema.clone())
            .build()
            .unwrap(),
    );
    Some(fx)
}

/// A store on the fixture's (migrated) schema, connecting with `url`.
fn builder(fx: &PgFixture, url: &str) -> StoreBuilder<PgConnection> {
    Store::builder(url)
        .schema(fx.schema.clone())
        .run_migrations(false)
}

/// The fixture's URL with the session starting in German (the superuser may set it).
fn german_url(fx: &PgFixture) -> String {
    let sep = if fx.url().contains('?') { '&' } else { '?' };
    format!("{}{sep}options=-c%20lc_messages%3D{GERMAN}", fx.url())
}

/// A login role of the test's own, not a superuser, whose sessions start with the
/// `lc_messages` a superuser gave it: it may not set it itself. Dropped with what it
/// owns.
struct Role {
    admin_url: String,
    name: String,
    url: String,
}

impl Role {
    fn create(fx: &PgFixture, lc_messages: &str, grants: &str) -> Self {
        let name = unique_name("lang");
        let mut admin = PgConnection::establish(fx.url()).unwrap();
        admin
            .batch_execute(&format!(
                "CREATE ROLE {name} LOGIN; \
                 ALTER ROLE {name} SET lc_messages = '{lc_messages}'; \
                 GRANT USAGE, CREATE ON SCHEMA \"{schema}\" TO {name}; \
                 GRANT ALL ON ALL TABLES IN SCHEMA \"{schema}\" TO {name}; \
                 GRANT ALL ON ALL SEQUENCES IN SCHEMA \"{schema}\" TO {name}; {grants}",
                schema = fx.schema,
                grants = grants.replace("{role}", &name),
            ))
            .unwrap();
        // The same server and database, as this role (trust authentication).
        let (scheme, rest) = fx.url().split_once("://").unwrap();
        let authority_end = rest.find('/').unwrap_or(rest.len());
        let host = match rest[..authority_end].rfind('@') {
            Some(at) => &rest[at + 1..],
            None => rest,
        };
        let url = format!("{scheme}://{name}@{host}");
        Self {
            admin_url: fx.url().to_owned(),
            name,
            url,
        }
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        if let Ok(mut admin) = PgConnection::establish(&self.admin_url) {
            let _ = admin.batch_execute(&format!(
                "DROP OWNED BY {0} CASCADE; DROP ROLE {0}",
                self.name
            ));
        }
    }
}

/// Takes one row of `locks`, waits until the other batch's handler holds the other
/// row, then asks for that one: the two batches deadlock and PostgreSQL aborts one
/// (40P01). Only a key's first call does this.
struct CrossLocker {
    group: ConsumerGroup,
    first_calls: Mutex<HashSet<String>>,
    both_hold_a_row: Barrier,
    calls: Mutex<Vec<String>>,
}

impl CrossLocker {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            group: group(GROUP),
            first_calls: Mutex::new(["a".to_owned(), "b".to_owned()].into()),
            both_hold_a_row: Barrier::new(2),
            calls: Mutex::new(Vec::new()),
        })
    }
}

impl Handler<PgConnection> for CrossLocker {
    type Message = Usage;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        "usage.recorded"
    }

    fn handle(
        &self,
        conn: &mut PgConnection,
        msg: Usage,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        let key = ctx.message_key().as_str();
        self.calls.lock().unwrap().push(key.to_owned());
        let (mine, theirs) = if key == "a" { (1, 2) } else { (2, 1) };
        if self.first_calls.lock().unwrap().remove(key) {
            conn.batch_execute(&format!("UPDATE locks SET v = v + 1 WHERE id = {mine}"))?;
            self.both_hold_a_row.wait();
            conn.batch_execute(&format!("UPDATE locks SET v = v + 1 WHERE id = {theirs}"))?;
        }
        conn.record_effect(key, msg.amount)?;
        Ok(())
    }
}

/// Builds a store for `url` with a [`CrossLocker`], then runs two one-message batches
/// ("a" and "b") at once; returns each batch's decision and the handler's calls.
fn deadlock_two_batches(
    fx: &PgFixture,
    url: &str,
) -> (Store<PgConnection>, [Decision; 2], Vec<String>) {
    let handler = CrossLocker::new();
    let store = builder(fx, url)
        .dyn_handler(handler.clone())
        .build()
        .unwrap();
    {
        // As the store's role, so that its handlers may use the tables.
        let mut conn = store.connection().unwrap();
        conn.batch_execute(
            "CREATE TABLE locks (id INT PRIMARY KEY, v INT NOT NULL); \
             INSERT INTO locks VALUES (1, 0), (2, 0);",
        )
        .unwrap();
        conn.create_effects().unwrap();
    }
    let batches = ["a", "b"].map(|k| {
        let store = store.clone();
        std::thread::spawn(move || {
            let mut decisions = store.process_batch(&group(GROUP), &[usage(k, 1)]).unwrap();
            assert_eq!(decisions.len(), 1);
            decisions.remove(0)
        })
    });
    let decisions = batches.map(|t| t.join().unwrap());
    let calls = handler.calls.lock().unwrap().clone();
    (store, decisions, calls)
}

/// (a) A deadlock between the handlers of two concurrent batches, on sessions that
/// start in German: contention, the losing batch runs again, no attempt counted.
#[test]
fn a_deadlock_on_a_translated_server_reruns_the_batch_without_counting() {
    let Some(fx) = translated_server() else {
        return;
    };
    let (store, decisions, calls) = deadlock_two_batches(&fx, &german_url(&fx));
    assert_eq!(decisions, [Decision::Processed, Decision::Processed]);
    assert_eq!(calls.len(), 3, "the deadlock's loser ran again: {calls:?}");
    for k in ["a", "b"] {
        let claim = store.claim_record(&key(k)).unwrap().unwrap();
        assert_eq!(
            (claim.status, claim.attempts, claim.last_error),
            (ClaimStatus::Done, 0, None),
            "{k}: a deadlock is not the message's fault"
        );
        assert_eq!(fx.connect().effects_of(k).unwrap(), 1, "{k}");
    }
    assert!(store.recognises_server_errors().unwrap());
}

/// Class-22 errors of the server on the store's connections, whose sessions start in
/// German.
fn data_errors() -> [(&'static str, &'static str); 3] {
    [
        ("22012", "SELECT 1/0"),
        ("22003", "SELECT 99999::smallint"),
        ("22P02", "SELECT 'abc'::int"),
    ]
}

/// (b) Data errors on a translated server are recognised as the data's.
#[test]
fn a_data_error_on_a_translated_server_is_recognised_as_data() {
    let Some(fx) = translated_server() else {
        return;
    };
    let store = builder(&fx, &german_url(&fx)).build().unwrap();
    let mut conn = store.connection().unwrap();
    for (state, sql) in data_errors() {
        let err = diesel::sql_query(sql).execute(&mut *conn).unwrap_err();
        assert_eq!(
            ErrorClass::of(&err),
            ErrorClass::Data,
            "{state} {sql}: {err}"
        );
    }
}

/// A role that may not set `lc_messages`, on a translated server: the store works,
/// says once that it cannot recognise the server's errors, and a deadlock counts as
/// an attempt (what the warning announces).
#[test]
fn a_role_that_may_not_set_lc_messages_is_warned_about_once() {
    let Some(fx) = translated_server() else {
        return;
    };
    capture_warnings();
    let role = Role::create(&fx, GERMAN, "");
    let (store, decisions, calls) = deadlock_two_batches(&fx, &role.url);
    // More pooled connections, each set up again.
    let held: Vec<_> = (0..2).map(|_| store.connection().unwrap()).collect();
    drop(held);
    assert!(!store.recognises_server_errors().unwrap());
    let warnings = warnings_for(&role.name);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("lc_messages"), "{}", warnings[0]);

    let mut conn = store.connection().unwrap();
    let err = diesel::sql_query("SELECT 1/0")
        .execute(&mut *conn)
        .unwrap_err();
    assert_eq!(ErrorClass::of(&err), ErrorClass::Other, "{err}");

    // The loser's call failed with a deadlock the store cannot recognise: its batch
    // runs again in isolation, where the loser is called once more (the winner has
    // committed by then) or fails again, counted.
    assert!((2..=3).contains(&calls.len()), "{calls:?}");
    let mut retried = 0;
    for (k, decision) in ["a", "b"].into_iter().zip(decisions) {
        let claim = store.claim_record(&key(k)).unwrap().unwrap();
        if let Decision::RetryAfter(_) = decision {
            retried += 1;
            assert_eq!(
                (claim.status, claim.attempts),
                (ClaimStatus::Failed, 1),
                "{k}"
            );
            let error = claim.last_error.unwrap_or_default();
            assert!(error.contains("Verklemmung"), "{k}: {error}");
        } else {
            assert_eq!(decision, Decision::Processed, "{k}");
        }
    }
    assert_eq!(
        retried,
        3 - calls.len(),
        "an attempt is counted exactly when the isolated rerun failed too"
    );
}

/// A role granted `SET` on `lc_messages` (PostgreSQL 15) gets the C locale.
#[test]
fn a_role_granted_set_on_lc_messages_is_not_warned_about() {
    let Some(fx) = translated_server() else {
        return;
    };
    capture_warnings();
    let role = Role::create(&fx, GERMAN, "GRANT SET ON PARAMETER lc_messages TO {role};");
    let store = builder(&fx, &role.url).build().unwrap();
    assert!(store.recognises_server_errors().unwrap());
    let mut conn = store.connection().unwrap();
    for (state, sql) in data_errors() {
        let err = diesel::sql_query(sql).execute(&mut *conn).unwrap_err();
        assert_eq!(
            ErrorClass::of(&err),
            ErrorClass::Data,
            "{state} {sql}: {err}"
        );
    }
    assert_eq!(warnings_for(&role.name), Vec::<String>::new());
}

/// A role whose own setting is already untranslated needs nothing: no warning.
#[test]
fn a_role_whose_own_lc_messages_is_c_is_not_warned_about() {
    let Some(fx) = translated_server() else {
        return;
    };
    capture_warnings();
    let role = Role::create(&fx, "C", "");
    let store = builder(&fx, &role.url).build().unwrap();
    assert!(store.recognises_server_errors().unwrap());
    assert_eq!(warnings_for(&role.name), Vec::<String>::new());
}

// ---- the warnings the store logs ----

/// (role field, message) of every warning logged in this process.
static WARNINGS: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

fn capture_warnings() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| tracing::subscriber::set_global_default(Warnings).unwrap());
}

fn warnings_for(role: &str) -> Vec<String> {
    WARNINGS
        .lock()
        .unwrap()
        .iter()
        .filter(|(r, _)| r == role)
        .map(|(_, m)| m.clone())
        .collect()
}

/// Records warnings, ignores everything else.
struct Warnings;

#[derive(Default)]
struct WarningFields {
    role: String,
    message: String,
}

impl Visit for WarningFields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "role" => self.role = format!("{value:?}"),
            "message" => self.message = format!("{value:?}"),
            _ => {}
        }
    }
}

impl Subscriber for Warnings {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() == Level::WARN
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut fields = WarningFields::default();
        event.record(&mut fields);
        WARNINGS.lock().unwrap().push((fields.role, fields.message));
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}
