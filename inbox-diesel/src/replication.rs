//! What PostgreSQL's replication promises for an acked message if the primary dies:
//! read from the server the store is connected to, for `inbox verify` and for a
//! service's own start-up check.
//!
//! A message is acked after its claim and effects commit. Whether that commit is on
//! a standby when the primary dies is the server's setting: with a synchronous
//! standby (`synchronous_standby_names`, `synchronous_commit` at `on`, `remote_write`
//! or `remote_apply`) it is; with asynchronous standbys, or `synchronous_commit`
//! `local` or `off`, the last acked messages' effects can be lost on failover (see
//! docs/postgres-failover.md).
//!
//! ```no_run
//! use inbox_diesel::replication::{inspect, Mode};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # use diesel::Connection;
//! let mut conn = diesel::PgConnection::establish("postgres://app@db1,db2/billing")?;
//! let report = inspect(&mut conn)?;
//! if report.mode() != Mode::Synchronous {
//!     for warning in report.warnings() {
//!         eprintln!("replication: warning: {warning}");
//!     }
//! }
//! # Ok(()) }
//! ```

use diesel::sql_types::{Bool, Nullable, Text};
use diesel::{PgConnection, QueryableByName, RunQueryDsl};

use crate::{Result, Store, StoreConnection};

/// The replication the server runs, as [`ReplicationReport::mode`] names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// At least one standby is synchronous and commits wait for it: an acked
    /// message's commit is on that standby.
    Synchronous,
    /// Standbys stream, but commits do not wait for any: the last acked messages'
    /// effects can be lost when one is promoted.
    Asynchronous,
    /// The server is itself a standby (in recovery): the store cannot write here.
    Standby,
    /// No standby is connected: there is nothing to fail over to.
    None,
}

impl Mode {
    /// The word `inbox verify` prints.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Synchronous => "synchronous",
            Self::Asynchronous => "asynchronous",
            Self::Standby => "standby",
            Self::None => "none",
        }
    }
}

/// One connected standby, from `pg_stat_replication`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Standby {
    /// Its `application_name`.
    pub name: String,
    /// `sync_state`: `sync`, `quorum`, `potential` or `async`; `None` where the role
    /// may not read it (it needs `pg_read_all_stats`).
    pub sync_state: Option<String>,
}

/// What [`inspect`] read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicationReport {
    /// `pg_is_in_recovery()`.
    pub in_recovery: bool,
    /// `synchronous_commit`.
    pub synchronous_commit: String,
    /// `synchronous_standby_names` (empty when unset).
    pub synchronous_standby_names: String,
    /// The connected standbys.
    pub standbys: Vec<Standby>,
}

#[derive(QueryableByName)]
struct Settings {
    #[diesel(sql_type = Bool)]
    in_recovery: bool,
    #[diesel(sql_type = Text)]
    synchronous_commit: String,
    #[diesel(sql_type = Text)]
    synchronous_standby_names: String,
}

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = Text)]
    application_name: String,
    #[diesel(sql_type = Nullable<Text>)]
    sync_state: Option<String>,
}

/// Reads the server's replication: its recovery state, `synchronous_commit`,
/// `synchronous_standby_names` and `pg_stat_replication`.
pub fn inspect(conn: &mut PgConnection) -> Result<ReplicationReport> {
    let settings: Settings = diesel::sql_query(
        "SELECT pg_is_in_recovery() AS in_recovery, \
                current_setting('synchronous_commit') AS synchronous_commit, \
                current_setting('synchronous_standby_names') AS synchronous_standby_names",
    )
    .get_result(conn)?;
    let standbys = diesel::sql_query(
        "SELECT application_name, sync_state FROM pg_stat_replication ORDER BY application_name",
    )
    .load::<Row>(conn)?
    .into_iter()
    .map(|r| Standby {
        name: r.application_name,
        sync_state: r.sync_state,
    })
    .collect();
    Ok(ReplicationReport {
        in_recovery: settings.in_recovery,
        synchronous_commit: settings.synchronous_commit,
        synchronous_standby_names: settings.synchronous_standby_names,
        standbys,
    })
}

/// [`inspect`] on a connection of the store's pool; `None` for a SQLite store.
pub fn inspect_store<C: StoreConnection>(store: &Store<C>) -> Result<Option<ReplicationReport>> {
    let mut conn = store.connection()?;
    let conn: &mut dyn std::any::Any = &mut *conn;
    match conn.downcast_mut::<PgConnection>() {
        Some(pg) => inspect(pg).map(Some),
        None => Ok(None),
    }
}

impl ReplicationReport {
    /// Whether commits wait for a standby at all (`synchronous_commit` neither
    /// `off` nor `local`).
    fn commits_wait(&self) -> bool {
        !matches!(self.synchronous_commit.as_str(), "off" | "local")
    }

    fn synchronous_standbys(&self) -> impl Iterator<Item = &Standby> {
        self.standbys
            .iter()
            .filter(|s| matches!(s.sync_state.as_deref(), Some("sync" | "quorum")))
    }

    /// The replication mode: a standby; no standby connected; synchronous when a
    /// connected standby is `sync` or `quorum` and commits wait for it; asynchronous
    /// otherwise.
    pub fn mode(&self) -> Mode {
        if self.in_recovery {
            Mode::Standby
        } else if self.standbys.is_empty() {
            Mode::None
        } else if self.commits_wait() && self.synchronous_standbys().next().is_some() {
            Mode::Synchronous
        } else {
            Mode::Asynchronous
        }
    }

    /// What an operator should know: each a sentence, empty when an acked message's
    /// commit is on a standby (or there is no standby to fail over to).
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.in_recovery {
            warnings.push(
                "this server is a standby (in recovery): the store cannot write here; \
                 list every host and add target_session_attrs=read-write to the URL"
                    .to_owned(),
            );
            return warnings;
        }
        if !self.commits_wait() && !self.standbys.is_empty() {
            warnings.push(format!(
                "synchronous_commit = {}: commits do not wait for any standby, so an acked \
                 message's effects can be lost on failover",
                self.synchronous_commit
            ));
        }
        let asynchronous: Vec<&str> = self
            .standbys
            .iter()
            .filter(|s| !matches!(s.sync_state.as_deref(), Some("sync" | "quorum")))
            .map(|s| s.name.as_str())
            .collect();
        if self.mode() == Mode::Asynchronous && !asynchronous.is_empty() {
            warnings.push(format!(
                "asynchronous standbys ({}): an acked message's effects can be lost if one \
                 is promoted",
                asynchronous.join(", ")
            ));
        }
        if !self.synchronous_standby_names.trim().is_empty()
            && self.synchronous_standbys().next().is_none()
        {
            warnings.push(format!(
                "synchronous_standby_names = '{}' but no synchronous standby is connected: \
                 commits wait until one is",
                self.synchronous_standby_names
            ));
        }
        warnings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(commit: &str, names: &str, standbys: &[(&str, Option<&str>)]) -> ReplicationReport {
        ReplicationReport {
            in_recovery: false,
            synchronous_commit: commit.to_owned(),
            synchronous_standby_names: names.to_owned(),
            standbys: standbys
                .iter()
                .map(|(n, s)| Standby {
                    name: (*n).to_owned(),
                    sync_state: s.map(str::to_owned),
                })
                .collect(),
        }
    }

    #[test]
    fn a_synchronous_standby_with_waiting_commits_is_synchronous_and_quiet() {
        for commit in ["on", "remote_write", "remote_apply"] {
            let r = report(commit, "s1", &[("s1", Some("sync"))]);
            assert_eq!(r.mode(), Mode::Synchronous, "{commit}");
            assert!(r.warnings().is_empty(), "{commit}: {:?}", r.warnings());
        }
        let r = report(
            "on",
            "ANY 1 (s1, s2)",
            &[("s1", Some("quorum")), ("s2", Some("quorum"))],
        );
        assert_eq!(r.mode(), Mode::Synchronous);
        assert!(r.warnings().is_empty(), "{:?}", r.warnings());
    }

    #[test]
    fn asynchronous_standbys_warn_that_acked_effects_can_be_lost() {
        let r = report("on", "", &[("s1", Some("async"))]);
        assert_eq!(r.mode(), Mode::Asynchronous);
        assert_eq!(
            r.warnings(),
            ["asynchronous standbys (s1): an acked message's effects can be lost if one is promoted"]
        );
        // A role that may not read sync_state: not known to be synchronous.
        let r = report("on", "", &[("s1", None)]);
        assert_eq!(r.mode(), Mode::Asynchronous);
    }

    #[test]
    fn commits_that_do_not_wait_make_a_synchronous_standby_asynchronous() {
        for commit in ["off", "local"] {
            let r = report(commit, "s1", &[("s1", Some("sync"))]);
            assert_eq!(r.mode(), Mode::Asynchronous, "{commit}");
            assert!(
                r.warnings()[0].starts_with(&format!("synchronous_commit = {commit}: ")),
                "{:?}",
                r.warnings()
            );
        }
    }

    #[test]
    fn a_named_synchronous_standby_that_is_not_connected_warns() {
        let r = report("on", "s1", &[]);
        assert_eq!(r.mode(), Mode::None);
        assert_eq!(r.warnings().len(), 1, "{:?}", r.warnings());
        assert!(r.warnings()[0].contains("no synchronous standby is connected"));
    }

    #[test]
    fn a_single_server_is_none_and_a_standby_says_so() {
        let r = report("on", "", &[]);
        assert_eq!(r.mode(), Mode::None);
        assert!(r.warnings().is_empty());
        let mut r = report("on", "", &[]);
        r.in_recovery = true;
        assert_eq!(r.mode(), Mode::Standby);
        assert!(r.warnings()[0].contains("target_session_attrs=read-write"));
    }
}
