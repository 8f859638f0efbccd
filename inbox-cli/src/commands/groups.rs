//! `groups` (halted groups, resume) and `stats`.

use inbox_diesel::operator::json;
use std::io::Write;

use inbox_core::ConsumerGroup;
use inbox_diesel::operator::OperatorConnection;
use inbox_diesel::operator::{ActivityQuery, Operator};
use inbox_diesel::Store;
use serde_json::{json, Value};

use crate::args::{GlobalArgs, GroupCommand};
use crate::exit;
use crate::failure::{failed, Failure, Outcome};
use crate::output::{self, print, print_json};

pub(crate) fn groups<C: OperatorConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    command: &GroupCommand,
    out: &mut dyn Write,
) -> Outcome {
    match command {
        GroupCommand::List => {
            let halted = Operator::new(store).list_halted_groups().map_err(failed)?;
            if global.json {
                let rows: Vec<Value> = halted.iter().map(json::halted_group).collect();
                return print_json(out, &json!({ "halted": rows }));
            }
            print(out, output::halts_text(&halted))
        }
        GroupCommand::Resume { group } => {
            ConsumerGroup::new(group).map_err(|e| Failure::new(exit::USAGE, e.to_string()))?;
            let resumed = Operator::new(store).resume_group(group).map_err(failed)?;
            if global.json {
                print_json(out, &json!({ "consumer_group": group, "resumed": resumed }))?;
            } else if resumed {
                print(
                    out,
                    format!(
                        "resumed consumer group {group}: its consumers resume at their next halt poll\n"
                    ),
                )?;
            }
            if !resumed {
                let failure = Failure::new(
                    exit::NOT_FOUND,
                    format!("consumer group {group} is not halted"),
                );
                return Err(if global.json {
                    failure.reported()
                } else {
                    failure
                });
            }
            Ok(())
        }
    }
}

pub(crate) fn stats<C: OperatorConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    out: &mut dyn Write,
) -> Outcome {
    let operator = Operator::new(store);
    let s = operator.operator_stats().map_err(failed)?;
    // The last day in hours, each count bounded (see `Operator::activity`).
    let activity = operator
        .activity(&ActivityQuery::default())
        .map_err(failed)?;
    if global.json {
        let mut doc = json::stats(&s);
        doc["activity"] = serde_json::to_value(&activity).map_err(failed)?;
        return print_json(out, &doc);
    }
    print(
        out,
        format!(
            "{}{}",
            output::stats_text(&s),
            output::activity_text(&activity)
        ),
    )
}
