//! A PostgreSQL server that takes no writes (a standby, or a primary set read-only,
//! as a connection finds one during a failover) is the store's state, not the
//! messages': the batch fails as infrastructure, nothing is counted against its
//! deliveries, nothing is dead-lettered, and the same deliveries go through once the
//! server takes writes again.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use inbox_core::Decision;
use inbox_diesel::{ErrorClass, Store};
use inbox_test_support::{claim_key, group, postgres_url, unique_name, usage, Recorder, TestConn};

const GROUP: &str = "billing.daily-usage";
const POOL: u32 = 2;

/// A database of the test's own (the read-only switch is per database), dropped
/// afterwards.
struct OwnDatabase {
    admin: String,
    name: String,
    url: String,
}

impl OwnDatabase {
    fn new() -> Option<Self> {
        let admin = postgres_url()?;
        let name = unique_name("ro");
        PgConnection::establish(&admin)
            .unwrap()
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .unwrap();
        let (base, query) = match admin.split_once('?') {
            Some((b, q)) => (b, format!("?{q}")),
            None => (admin.as_str(), String::new()),
        };
        let server = &base[..base.rfind('/').unwrap()];
        let url = format!("{server}/{name}{query}");
        Some(Self { admin, name, url })
    }

    /// Ends the database's sessions (the store's pooled connections among them).
    fn terminate_sessions(&self) {
        PgConnection::establish(&self.admin)
            .unwrap()
            .batch_execute(&format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = '{}' AND pid <> pg_backend_pid()",
                self.name
            ))
            .unwrap();
    }

    /// Sets the database read-only (or back) and ends its sessions, so that every
    /// connection the store opens next starts with the new default.
    fn read_only(&self, on: bool) {
        let mut conn = PgConnection::establish(&self.admin).unwrap();
        let setting = if on { "on" } else { "off" };
        conn.batch_execute(&format!(
            "ALTER DATABASE \"{}\" SET default_transaction_read_only = {setting}",
            self.name
        ))
        .unwrap();
        conn.batch_execute(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = '{}' AND pid <> pg_backend_pid()",
            self.name
        ))
        .unwrap();
    }
}

impl Drop for OwnDatabase {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.admin) {
            let _ = conn.batch_execute(&format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.name
            ));
        }
    }
}

#[test]
fn a_read_only_server_fails_the_batch_as_infrastructure_and_counts_nothing() {
    let Some(db) = OwnDatabase::new() else {
        return;
    };
    let handler = Recorder::new(GROUP);
    let calls = handler.calls();
    let store = Store::<PgConnection>::builder(db.url.clone())
        .pool_size(POOL)
        .handler(handler)
        .build()
        .unwrap();
    PgConnection::establish(&db.url)
        .unwrap()
        .create_effects()
        .unwrap();

    db.read_only(true);
    let batch = [usage("a", 1), usage("b", 2)];
    for _ in 0..3 {
        let err = store.process_batch(&group(GROUP), &batch).unwrap_err();
        let inbox_diesel::Error::Database(cause) = &err else {
            panic!("expected a database error, found {err:?}");
        };
        assert_eq!(
            ErrorClass::of(cause),
            ErrorClass::Infrastructure,
            "a read-only server is not the messages' fault: {cause}"
        );
    }
    // Reads still work on a read-only server: nothing was recorded.
    for k in ["a", "b"] {
        assert_eq!(store.claim_record(&claim_key(GROUP, k)).unwrap(), None);
    }
    assert!(store.dead_letters(&group(GROUP)).unwrap().is_empty());
    assert!(calls.lock().unwrap().is_empty(), "no handler ran");

    db.read_only(false);
    // Each pooled connection whose session was ended fails one call (as
    // infrastructure) and is discarded: at most `POOL` calls fail, then the batch goes.
    let mut failed = 0;
    let decisions = loop {
        match store.process_batch(&group(GROUP), &batch) {
            Ok(decisions) => break decisions,
            Err(inbox_diesel::Error::Database(cause)) if failed < POOL => {
                assert_eq!(
                    ErrorClass::of(&cause),
                    ErrorClass::Infrastructure,
                    "{cause}"
                );
                failed += 1;
            }
            Err(err) => panic!("after {failed} failed calls: {err:?}"),
        }
    };
    assert_eq!(decisions, [Decision::Processed, Decision::Processed]);
    for k in ["a", "b"] {
        let claim = store.claim_record(&claim_key(GROUP, k)).unwrap().unwrap();
        assert_eq!(claim.attempts, 0, "{k}: nothing counted");
    }
    assert!(store.dead_letters(&group(GROUP)).unwrap().is_empty());
    let mut conn = PgConnection::establish(&db.url).unwrap();
    assert_eq!(conn.effect_count().unwrap(), 2);
    drop(store);
}

/// A standby's refusal, as a hot standby words it, is infrastructure too.
#[test]
fn a_standby_refusal_is_infrastructure() {
    use diesel::result::{DatabaseErrorKind, Error};
    for msg in [
        "cannot execute INSERT in a read-only transaction",
        "cannot execute nextval() in a read-only transaction",
        "recovery is in progress",
        "cannot execute pg_advisory_xact_lock() during recovery",
    ] {
        let err = Error::DatabaseError(DatabaseErrorKind::Unknown, Box::new(msg.to_owned()));
        assert_eq!(ErrorClass::of(&err), ErrorClass::Infrastructure, "{msg}");
    }
}

/// A pooled connection whose session ended while it was idle (a server restarted,
/// a primary that died) fails the one call that meets it and leaves the pool: the
/// calls after it get new connections, for statements outside a transaction (the
/// reads) as for batches.
#[test]
fn a_connection_lost_while_idle_fails_at_most_one_call_per_connection() {
    let Some(db) = OwnDatabase::new() else {
        return;
    };
    let store = Store::<PgConnection>::builder(db.url.clone())
        .pool_size(POOL)
        .handler(Recorder::new(GROUP))
        .build()
        .unwrap();
    PgConnection::establish(&db.url)
        .unwrap()
        .create_effects()
        .unwrap();
    // Both pooled connections exist and are idle.
    let (a, b) = (store.connection().unwrap(), store.connection().unwrap());
    drop((a, b));
    for round in 0..3 {
        db.terminate_sessions();
        let mut failed = 0;
        loop {
            match store.claim_record(&claim_key(GROUP, "a")) {
                Ok(_) => break,
                Err(inbox_diesel::Error::Database(cause)) if failed < POOL => {
                    assert_eq!(
                        ErrorClass::of(&cause),
                        ErrorClass::Infrastructure,
                        "{cause}"
                    );
                    failed += 1;
                }
                Err(err) => panic!("round {round}, after {failed} failed calls: {err:?}"),
            }
        }
        let k = format!("k{round}");
        let decisions = store.process_batch(&group(GROUP), &[usage(&k, 1)]).unwrap();
        assert_eq!(decisions, [Decision::Processed], "round {round}");
    }
}
