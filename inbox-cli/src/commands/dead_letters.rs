//! `dead-letters`: list, show, failure groups, replay and discard.

use inbox_diesel::operator::json;
use std::io::Write;

use inbox_diesel::operator::Operator;
use inbox_diesel::operator::{
    DeadLetterFilter, DiscardOutcome, LetterStatus, OperatorConnection, ReplayOutcome, ReplayTarget,
};
use inbox_diesel::Store;
use serde_json::{json, Value};

use crate::args::{DeadLetterCommand, FilterArgs, GlobalArgs, StatusArg};
use crate::commands::parse_time;
use crate::exit;
use crate::failure::{failed, Failure, Outcome};
use crate::output::{self, print, print_json, Table};

fn filter<C: OperatorConnection>(
    store: &Store<C>,
    args: &FilterArgs,
    default: StatusArg,
) -> Result<DeadLetterFilter, Failure> {
    let now = store.clock().now();
    let mut f = DeadLetterFilter::default();
    f.consumer_group.clone_from(&args.consumer_group);
    f.reason = args.reason;
    f.message_type.clone_from(&args.message_type);
    f.message_key.clone_from(&args.key);
    f.failure_group.clone_from(&args.group);
    if let Some(since) = &args.since {
        f.since = Some(parse_time(since, now)?);
    }
    if let Some(until) = &args.until {
        f.until = Some(parse_time(until, now)?);
    }
    f.status = match args.status.unwrap_or(default) {
        StatusArg::Pending => Some(LetterStatus::Pending),
        StatusArg::Replayed => Some(LetterStatus::Replayed),
        StatusArg::Discarded => Some(LetterStatus::Discarded),
        StatusArg::Active => None,
    };
    Ok(f)
}

pub(crate) fn dead_letters<C: OperatorConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    target: &ReplayTarget,
    command: &DeadLetterCommand,
    out: &mut dyn Write,
) -> Outcome {
    let json = global.json;
    match command {
        DeadLetterCommand::List {
            filter: args,
            limit,
            offset,
        } => list(json, store, args, *offset, *limit, out),
        DeadLetterCommand::Show { id } => {
            let details = Operator::new(store)
                .dead_letter_details(*id)
                .map_err(failed)?
                .ok_or_else(|| Failure::new(exit::NOT_FOUND, format!("no dead letter {id}")))?;
            if json {
                return print_json(out, &json::dead_letter_details(&details));
            }
            print(out, output::details_text(&details))
        }
        DeadLetterCommand::Groups { filter: args } => groups(json, store, args, out),
        DeadLetterCommand::Replay { id: Some(id), .. } => {
            replay_one(global, store, target, *id, out)
        }
        DeadLetterCommand::Replay {
            id: None,
            filter: args,
            limit,
            yes,
        } => replay_many(json, store, target, args, *limit, *yes, out),
        DeadLetterCommand::Discard { id: Some(id), .. } => discard_one(json, store, *id, out),
        DeadLetterCommand::Discard {
            id: None,
            filter: args,
            limit,
            yes,
        } => discard_many(json, store, args, *limit, *yes, out),
    }
}

/// `dead-letters list`.
fn list<C: OperatorConnection>(
    json: bool,
    store: &Store<C>,
    args: &FilterArgs,
    offset: usize,
    limit: usize,
    out: &mut dyn Write,
) -> Outcome {
    let f = filter(store, args, StatusArg::Active)?;
    let letters = Operator::new(store)
        .list_dead_letters(&f, offset, limit)
        .map_err(failed)?;
    if json {
        let rows: Vec<Value> = letters.iter().map(json::dead_letter).collect();
        return print_json(
            out,
            &json!({ "dead_letters": rows, "offset": offset, "limit": limit }),
        );
    }
    let mut table = Table::new([
        "ID",
        "GROUP",
        "KEY",
        "TYPE",
        "REASON",
        "ATTEMPTS",
        "REPLAYS",
        "STATUS",
        "FAILURE_GROUP",
        "DEAD_LETTERED_AT",
        "LAST_ERROR",
    ]);
    for e in &letters {
        table.row([
            e.id.to_string(),
            e.consumer_group.clone(),
            e.message_key.clone(),
            e.message_type.clone(),
            e.reason.as_str().to_owned(),
            e.attempts.to_string(),
            e.replay_count.to_string(),
            e.status.as_str().to_owned(),
            e.failure_group.clone(),
            output::time(e.dead_lettered_at),
            output::first_line(e.last_error.as_deref()),
        ]);
    }
    print(
        out,
        table.render(&format!("{} dead letters", letters.len())),
    )
}

/// `dead-letters groups`.
fn groups<C: OperatorConnection>(
    json: bool,
    store: &Store<C>,
    args: &FilterArgs,
    out: &mut dyn Write,
) -> Outcome {
    let f = filter(store, args, StatusArg::Pending)?;
    let groups = Operator::new(store).failure_groups(&f).map_err(failed)?;
    if json {
        let rows: Vec<Value> = groups.iter().map(json::failure_group).collect();
        return print_json(out, &json!({ "failure_groups": rows }));
    }
    let mut table = Table::new([
        "FAILURE_GROUP",
        "COUNT",
        "REASON",
        "TYPE",
        "CONSUMER_GROUPS",
        "REPLAYABLE",
        "FIRST_SEEN",
        "LAST_SEEN",
        "SIGNATURE",
    ]);
    for g in &groups {
        table.row([
            g.fingerprint.clone(),
            g.count.to_string(),
            g.reason.as_str().to_owned(),
            g.message_type.clone(),
            g.consumer_groups.join(","),
            if g.replayable { "yes" } else { "no" }.to_owned(),
            output::time(g.first_seen),
            output::time(g.last_seen),
            g.signature.clone(),
        ]);
    }
    print(
        out,
        table.render(&format!("{} failure groups", groups.len())),
    )
}

/// `dead-letters replay` with a filter.
fn replay_many<C: OperatorConnection>(
    json: bool,
    store: &Store<C>,
    target: &ReplayTarget,
    args: &FilterArgs,
    limit: Option<usize>,
    yes: bool,
    out: &mut dyn Write,
) -> Outcome {
    let f = filter(store, args, StatusArg::Pending)?;
    confirm(store, &f, limit, yes, "replay")?;
    let report = Operator::new(store)
        .replay_dead_letters(&f, limit, target)
        .map_err(failed)?;
    if json {
        return print_json(out, &json::bulk_replay(&report));
    }
    print(
        out,
        format!(
            "replayed {} of {} dead letters ({} refused for their reason, {} skipped: \
             claim no longer dead)\n",
            report.affected, report.matched, report.refused, report.skipped
        ),
    )
}

/// `dead-letters discard <ID>`.
fn discard_one<C: OperatorConnection>(
    json: bool,
    store: &Store<C>,
    id: i64,
    out: &mut dyn Write,
) -> Outcome {
    let outcome = Operator::new(store)
        .discard_dead_letter(id)
        .map_err(failed)?;
    let name = match outcome {
        DiscardOutcome::Discarded => "discarded",
        DiscardOutcome::AlreadyDiscarded => "already_discarded",
        _ => "not_found",
    };
    if json {
        print_json(out, &json::discard_outcome(id, outcome))?;
    } else {
        print(
            out,
            format!("dead letter {id}: {}\n", name.replace('_', " ")),
        )?;
    }
    if name == "not_found" {
        Err(Failure::new(exit::NOT_FOUND, format!("no dead letter {id}")).reported())
    } else {
        Ok(())
    }
}

/// `dead-letters discard` with a filter.
fn discard_many<C: OperatorConnection>(
    json: bool,
    store: &Store<C>,
    args: &FilterArgs,
    limit: Option<usize>,
    yes: bool,
    out: &mut dyn Write,
) -> Outcome {
    let f = filter(store, args, StatusArg::Pending)?;
    confirm(store, &f, limit, yes, "discard")?;
    let report = Operator::new(store)
        .discard_dead_letters(&f, limit)
        .map_err(failed)?;
    if json {
        return print_json(out, &json::bulk_discard(&report));
    }
    print(
        out,
        format!(
            "discarded {} of {} dead letters\n",
            report.affected, report.matched
        ),
    )
}

/// A bulk change needs --yes; without it, says how many letters it would touch.
fn confirm<C: OperatorConnection>(
    store: &Store<C>,
    f: &DeadLetterFilter,
    limit: Option<usize>,
    yes: bool,
    what: &str,
) -> Outcome {
    if yes {
        return Ok(());
    }
    let n = Operator::new(store)
        .list_dead_letters(f, 0, limit.unwrap_or(usize::MAX))
        .map_err(failed)?
        .len();
    Err(Failure::new(
        exit::USAGE,
        format!("refusing to {what} {n} dead letters without --yes"),
    ))
}

fn replay_one<C: OperatorConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    target: &ReplayTarget,
    id: i64,
    out: &mut dyn Write,
) -> Outcome {
    let outcome = Operator::new(store)
        .replay_dead_letter(id, target)
        .map_err(failed)?;
    let (text, failure) = match &outcome {
        ReplayOutcome::Replayed {
            sequence,
            outbox_id,
        } => (
            format!("dead letter {id}: replayed (replay {sequence}, outbox row {outbox_id})\n"),
            None,
        ),
        ReplayOutcome::Refused { reason, advice } => (
            format!("dead letter {id}: refused ({reason}): {advice}\n"),
            Some(Failure::new(
                exit::REFUSED,
                format!("dead letter {id} is not replayable ({reason})"),
            )),
        ),
        ReplayOutcome::ClaimNotDead { status } => {
            let status = status.map_or("none", |s| s.as_str());
            (
                format!(
                    "dead letter {id}: nothing enqueued: its claim is {status}, not dead (replayed already?)\n"
                ),
                None,
            )
        }
        ReplayOutcome::Discarded => (
            format!("dead letter {id}: discarded, not replayed\n"),
            Some(Failure::new(
                exit::REFUSED,
                format!("dead letter {id} is discarded"),
            )),
        ),
        _ => (
            format!("no dead letter {id}\n"),
            Some(Failure::new(
                exit::NOT_FOUND,
                format!("no dead letter {id}"),
            )),
        ),
    };
    if global.json {
        print_json(out, &json::replay_outcome(id, &outcome))?;
    } else {
        print(out, text)?;
    }
    failure.map_or(Ok(()), |f| Err(f.reported()))
}
