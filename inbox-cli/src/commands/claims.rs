//! `claims`: a key's claims, and redriving failed claims.

use inbox_diesel::operator::json;
use std::io::Write;

use inbox_diesel::operator::Operator;
use inbox_diesel::operator::{OperatorConnection, RedriveFilter, ReplayTarget};
use inbox_diesel::Store;
use serde_json::{json, Value};

use crate::args::{ClaimCommand, GlobalArgs};
use crate::commands::duration_arg;
use crate::exit;
use crate::failure::{failed, Failure, Outcome};
use crate::output::{self, print, print_json, Table};

pub(crate) fn claims<C: OperatorConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    target: &ReplayTarget,
    command: &ClaimCommand,
    out: &mut dyn Write,
) -> Outcome {
    match command {
        ClaimCommand::Show {
            key,
            consumer_group,
        } => {
            let claims: Vec<_> = Operator::new(store)
                .claims_for_key(key)
                .map_err(failed)?
                .into_iter()
                .filter(|c| consumer_group.as_ref().is_none_or(|g| *g == c.group))
                .collect();
            if global.json {
                let rows: Vec<Value> = claims.iter().map(json::claim).collect();
                print_json(out, &json!({ "claims": rows }))?;
            } else {
                let mut table = Table::new([
                    "GROUP",
                    "KEY",
                    "TYPE",
                    "STATUS",
                    "ATTEMPTS",
                    "STARTS",
                    "NEXT_ATTEMPT_AT",
                    "PAYLOAD_KEPT",
                    "UPDATED_AT",
                    "LAST_ERROR",
                ]);
                for c in &claims {
                    table.row([
                        c.group.clone(),
                        c.key.clone(),
                        c.message_type.clone(),
                        c.status.as_str().to_owned(),
                        c.attempts.to_string(),
                        c.starts.to_string(),
                        c.next_attempt_at.map(output::time).unwrap_or_default(),
                        if c.has_payload { "yes" } else { "no" }.to_owned(),
                        output::time(c.updated_at),
                        output::first_line(c.last_error.as_deref()),
                    ]);
                }
                print(out, table.render(&format!("{} claims", claims.len())))?;
            }
            if claims.is_empty() {
                return Err(
                    Failure::new(exit::NOT_FOUND, format!("no claim of key {key:?}")).reported(),
                );
            }
            Ok(())
        }
        ClaimCommand::Redrive {
            consumer_group,
            key,
            overdue_for,
            limit,
            yes,
        } => {
            let mut f =
                RedriveFilter::default().overdue_for(duration_arg(overdue_for, "overdue-for")?);
            f.consumer_group.clone_from(consumer_group);
            f.message_key.clone_from(key);
            if !yes {
                return Err(Failure::new(
                    exit::USAGE,
                    "refusing to redrive claims without --yes",
                ));
            }
            let report = Operator::new(store)
                .redrive_failed_claims(&f, *limit, target)
                .map_err(failed)?;
            if global.json {
                return print_json(
                    out,
                    &json!({
                        "matched": report.matched,
                        "redriven": report.affected,
                        "skipped": report.skipped,
                    }),
                );
            }
            print(
                out,
                format!(
                    "redrove {} of {} failed claims ({} changed meanwhile)\n",
                    report.affected, report.matched, report.skipped
                ),
            )
        }
    }
}
