//! `verify`: the live schema, PostgreSQL's replication (what an acked message's
//! effects risk on failover), and with `--amqp-url` the broker's topology.

use std::io::Write;

use inbox_core::display::escape;
use inbox_core::{parse_ladder, redact_message, ConsumerGroup, RetryLadder};
use inbox_diesel::operator::Operator;
use inbox_diesel::operator::OperatorConnection;
use inbox_diesel::Store;
use serde_json::json;

use crate::args::{GlobalArgs, VerifyArgs};
use crate::exit;
use crate::failure::{Failure, Outcome};
use crate::output::{print, print_json};

pub(crate) fn verify<C: OperatorConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    args: &VerifyArgs,
    out: &mut dyn Write,
) -> Outcome {
    let schema = store.verify_schema();
    let replication = inbox_diesel::replication::inspect_store(store);
    let replication_error = replication.as_ref().err().map(ToString::to_string);
    let report = replication.as_ref().ok().cloned().flatten();
    let warnings = report.as_ref().map(|r| r.warnings()).unwrap_or_default();
    let topology = match (&args.amqp_url, &schema) {
        (Some(amqp), Ok(())) => Some(check_topology(global, store, args, amqp)),
        _ => None,
    };
    let schema_error = schema.as_ref().err().map(ToString::to_string);
    let topology_error = topology
        .as_ref()
        .and_then(|t| t.as_ref().err().map(ToString::to_string));
    let checked = topology
        .as_ref()
        .and_then(|t| t.as_ref().ok().cloned())
        .unwrap_or_default();
    if global.json {
        print_json(
            out,
            &json!({
                "schema": if schema_error.is_none() { "ok" } else { "error" },
                "schema_error": schema_error,
                "replication": match (&replication, &report) {
                    (Err(_), _) => "error",
                    (Ok(_), None) => "skipped",
                    (Ok(_), Some(r)) => r.mode().as_str(),
                },
                "replication_error": replication_error,
                "replication_warnings": warnings,
                "replication_standbys": report.as_ref().map(|r| r.standbys.iter().map(|s| s.name.clone()).collect::<Vec<_>>()),
                "synchronous_commit": report.as_ref().map(|r| r.synchronous_commit.clone()),
                "topology": match &topology { None => "skipped", Some(Ok(_)) => "ok", Some(Err(_)) => "error" },
                "topology_error": topology_error,
                "queues_checked": checked,
            }),
        )?;
    } else {
        let mut text = match &schema_error {
            None => "schema: ok\n".to_owned(),
            Some(e) => format!("schema: error: {}\n", escape(e)),
        };
        text.push_str(&replication_line(
            report.as_ref(),
            replication_error.as_deref(),
        ));
        for w in &warnings {
            text.push_str(&format!("replication: warning: {}\n", escape(w)));
        }
        text.push_str(&match &topology {
            None if args.amqp_url.is_none() => "topology: skipped (no AMQP_URL)\n".to_owned(),
            None => "topology: skipped (the schema failed)\n".to_owned(),
            Some(Ok(queues)) => format!("topology: ok ({} queues)\n", queues.len()),
            Some(Err(e)) => format!("topology: error: {}\n", escape(&e.to_string())),
        });
        print(out, text)?;
    }
    if let (Err(err), Some(e)) = (&schema, schema_error) {
        return Err(Failure::new(schema_exit_code(err), e).reported());
    }
    if let Some(e) = replication_error {
        return Err(Failure::new(exit::FAILURE, e).reported());
    }
    if let Some(Err(e)) = topology {
        return Err(Failure::new(e.exit_code(), e.to_string()).reported());
    }
    Ok(())
}

/// The `replication:` line: the mode and what it is made of.
fn replication_line(
    report: Option<&inbox_diesel::replication::ReplicationReport>,
    error: Option<&str>,
) -> String {
    use inbox_diesel::replication::Mode;
    if let Some(e) = error {
        return format!("replication: error: {}\n", escape(e));
    }
    let Some(r) = report else {
        return "replication: skipped (SQLite)\n".to_owned();
    };
    let names = r
        .standbys
        .iter()
        .map(|s| escape(&s.name).to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let detail = match r.mode() {
        Mode::Standby => "in recovery".to_owned(),
        Mode::None => "no standby connected".to_owned(),
        _ => format!(
            "standbys: {names}; synchronous_commit = {}",
            escape(&r.synchronous_commit)
        ),
    };
    format!("replication: {} ({detail})\n", r.mode().as_str())
}

/// Why the topology check did not pass, by whose it is.
#[derive(Debug)]
enum TopologyError {
    /// The broker (or the database) failed: unreachable, refused the login, closed the
    /// connection, or answered a declare with anything but "not found" (exit 1).
    Failed(String),
    /// The exchange or a queue does not exist (exit 3).
    Missing(String),
    /// No consumer group to check: none has a claim and none was named (exit 2).
    NoGroups,
    /// A bad argument of the check itself (exit 2).
    Usage(String),
}

impl TopologyError {
    fn exit_code(&self) -> u8 {
        match self {
            Self::Failed(_) => exit::FAILURE,
            Self::Missing(_) => exit::SCHEMA,
            Self::NoGroups | Self::Usage(_) => exit::USAGE,
        }
    }
}

impl std::fmt::Display for TopologyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Failed(e) | Self::Missing(e) | Self::Usage(e) => f.write_str(e),
            Self::NoGroups => f.write_str(
                "nothing to check: no consumer group has a claim yet; name the groups with \
                 --consumer-group",
            ),
        }
    }
}

/// Passive declares of the exchange and of every group's queue, dead-letter queue,
/// parking queue (`:unreadable`) and retry tiers; returns the queues checked. Errors name the object, never the URL.
fn check_topology<C: OperatorConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    args: &VerifyArgs,
    amqp_url: &str,
) -> Result<Vec<String>, TopologyError> {
    let usage = |e: String| TopologyError::Usage(e);
    let ladder = match &args.retry_ladder {
        Some(text) => parse_ladder(text).map_err(|e| usage(format!("--retry-ladder: {e}")))?,
        None => RetryLadder::default(),
    };
    let mut groups = args.consumer_groups.clone();
    if groups.is_empty() {
        groups = Operator::new(store)
            .operator_stats()
            .map_err(|e| TopologyError::Failed(format!("database: {e}")))?
            .groups
            .into_iter()
            .map(|g| g.consumer_group)
            .collect();
    }
    if groups.is_empty() {
        // "ok (0 queues)" would say the topology matches having checked nothing.
        return Err(TopologyError::NoGroups);
    }
    let mut topology =
        inbox_amqp::Topology::new(args.exchange.clone().unwrap_or_else(|| "unused".to_owned()))
            .and_then(|t| t.prefix(global.prefix.clone()))
            .map_err(|e| usage(e.to_string()))?
            .ladder(ladder);
    for g in &groups {
        let group =
            ConsumerGroup::new(g.as_str()).map_err(|e| usage(format!("--consumer-group: {e}")))?;
        topology = topology.group(group, Vec::<String>::new());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| TopologyError::Failed(e.to_string()))?;
    runtime.block_on(async {
        // The consumer's rules: `amqps://` with the feature `rustls`, the CA of
        // --ca-cert / AMQP_CA_CERT, no password in any error. A refused connection or
        // login is the broker's failure, not a topology that does not match.
        let conn = inbox_amqp::connect(amqp_url, args.ca_cert.as_deref())
            .await
            .map_err(|e| {
                TopologyError::Failed(format!("broker: {}", inbox_core::ErrorChain(&e)))
            })?;
        let checked = topology.check(&conn, args.exchange.is_some()).await;
        let _ = conn.close(200, "verified".into()).await;
        checked.map_err(|e| match e {
            inbox_amqp::Error::TopologyMissing { .. } => TopologyError::Missing(e.to_string()),
            other => TopologyError::Failed(format!(
                "broker: {}",
                inbox_amqp::BrokerUrls::items(amqp_url)
                    .into_iter()
                    .fold(inbox_core::ErrorChain(&other).to_string(), |text, url| {
                        redact_message(&text, url)
                    })
            )),
        })
    })
}

/// 3 when the schema does not match, whatever the table; 1 when it could not be
/// read at all (a database error: the catalog was never compared).
fn schema_exit_code(err: &inbox_diesel::Error) -> u8 {
    match err {
        inbox_diesel::Error::SchemaMismatch { .. } => exit::SCHEMA,
        _ => exit::FAILURE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_diesel::{SchemaPart, SchemaProblem};

    #[test]
    fn a_mismatch_exits_3_and_a_schema_that_cannot_be_read_exits_1() {
        let mismatch = inbox_diesel::Error::SchemaMismatch {
            part: SchemaPart::Rebuild,
            problem: SchemaProblem::MissingTable,
            expected: "table inbox_rebuild_runs".to_owned(),
            found: "no such table".to_owned(),
            table: "inbox_rebuild_runs".to_owned(),
        };
        assert_eq!(schema_exit_code(&mismatch), exit::SCHEMA);
        let unread = inbox_diesel::Error::Database(diesel::result::Error::BrokenTransactionManager);
        assert_eq!(schema_exit_code(&unread), exit::FAILURE);
    }
}
