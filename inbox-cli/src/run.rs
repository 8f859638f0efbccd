//! Carrying out a command against a store.

use std::io::Write;
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::{PgConnection, SqliteConnection};
use inbox_core::display::escape;
use inbox_core::{parse_duration, parse_ladder, redact_message, ConsumerGroup, RetryLadder};
use inbox_diesel::{
    Backend, DeadLetterFilter, DiscardOutcome, LetterStatus, RedriveFilter, ReplayOutcome,
    ReplayTarget, Retention, Store, StoreConnection,
};
use serde_json::{json, Value};

use crate::args::{
    ClaimCommand, Command, DeadLetterCommand, FilterArgs, GlobalArgs, GroupCommand, PurgeArgs,
    StatusArg, VerifyArgs,
};
use crate::exit;
use crate::output::{self, Table};

/// Why a command did not succeed, and the exit code that says so.
#[derive(Debug)]
pub struct Failure {
    /// The exit code (see [`exit`](crate::exit)).
    pub code: u8,
    /// What to tell the operator (credentials redacted).
    pub message: String,
    /// Whether the command's own output (its JSON document) was printed already.
    pub reported: bool,
}

impl Failure {
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            reported: false,
        }
    }

    /// The same failure, after the command printed its own result.
    pub(crate) fn reported(mut self) -> Self {
        self.reported = true;
        self
    }
}

pub(crate) type Outcome = Result<(), Failure>;

/// Runs `command`, printing to stdout and stderr; returns the exit code.
///
/// No lock of stdout is held while the command runs, only while one piece of output
/// is written: the broker client's I/O thread logs through the host's `tracing`
/// subscriber, which may write to stdout, and a lock held across the broker calls
/// would stop that thread and with it the reply the command waits for.
pub fn run(global: &GlobalArgs, command: &Command) -> std::process::ExitCode {
    let code = run_with(global, command, &mut std::io::stdout());
    std::process::ExitCode::from(code)
}

/// Runs `command`, printing its output to `out` and its error to stderr; returns the
/// exit code. For hosts that capture the output. `out` is written once per piece of
/// output, after the database and broker calls that produce it; pass no lock that a
/// logger of the process also needs (such as [`std::io::StdoutLock`]: see [`run`]).
pub fn run_with(global: &GlobalArgs, command: &Command, out: &mut dyn Write) -> u8 {
    match execute(global, command, out) {
        Ok(()) => exit::OK,
        Err(failure) => {
            let message = redact(&failure.message, global, command);
            if global.json && !failure.reported {
                let _ = print_json(out, &json!({ "error": message, "exit_code": failure.code }));
            }
            // One line, whatever the message quotes (a driver's text, a stored key).
            eprintln!("inbox: {}", escape(&message));
            failure.code
        }
    }
}

/// `message` without the password of any URL the command was given.
fn redact(message: &str, global: &GlobalArgs, command: &Command) -> String {
    let amqp = match command {
        Command::Verify(args) => args.amqp_url.as_deref(),
        Command::Selftest(args) => args.amqp_url.as_deref(),
        _ => None,
    };
    global
        .database_url
        .iter()
        .map(String::as_str)
        .chain(amqp)
        .fold(message.to_owned(), |text, url| redact_message(&text, url))
}

fn execute(global: &GlobalArgs, command: &Command, out: &mut dyn Write) -> Outcome {
    let url = global.database_url.clone().ok_or_else(|| {
        Failure::new(
            exit::USAGE,
            "no database: set DATABASE_URL or pass --database-url",
        )
    })?;
    match database(&url)? {
        (Backend::Postgres, url) => on_store::<PgConnection>(global, &url, command, out),
        (_, url) => on_store::<SqliteConnection>(global, &url, command, out),
    }
}

/// The forms of `--database-url` the commands take, as an error says them.
const ACCEPTED_URLS: &str =
    "a postgres:// (or postgresql://) URL, or sqlite://PATH of an existing SQLite file";

/// The backend of `--database-url`: a `postgres://` or `postgresql://` URL, or a
/// `sqlite://` URL of a file that exists. Anything else (a libpq `host=... password=...`
/// string, a bare path, another scheme) is a usage error that never quotes the value:
/// it may hold a password. A missing SQLite file is never created: the operator
/// commands run no migrations, so a new file could only fail their schema check.
fn database(url: &str) -> Result<(Backend, String), Failure> {
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
        return Ok((Backend::Postgres, url.to_owned()));
    }
    if lower.starts_with("sqlite:") {
        let rest = &url["sqlite:".len()..];
        let path = rest.strip_prefix("//").unwrap_or(rest);
        if path.is_empty() {
            return Err(Failure::new(
                exit::USAGE,
                format!("--database-url (DATABASE_URL): expected {ACCEPTED_URLS}, found sqlite:// without a path"),
            ));
        }
        if !std::path::Path::new(path).is_file() {
            return Err(Failure::new(
                exit::FAILURE,
                format!("no SQLite database at {path:?} (the operator commands never create one)"),
            ));
        }
        return Ok((Backend::Sqlite, format!("sqlite://{path}")));
    }
    let found = match url.split_once("://") {
        Some((scheme, _))
            if !scheme.is_empty()
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
        {
            format!("a {scheme}:// URL")
        }
        _ => "a value of another form".to_owned(),
    };
    Err(Failure::new(
        exit::USAGE,
        format!("--database-url (DATABASE_URL): expected {ACCEPTED_URLS}; found {found} (not shown: it may hold a password)"),
    ))
}

pub(crate) fn failed(err: impl std::fmt::Display) -> Failure {
    Failure::new(exit::FAILURE, err.to_string())
}

fn open<C: StoreConnection>(
    global: &GlobalArgs,
    url: &str,
    checked: bool,
) -> Result<Store<C>, Failure> {
    let mut builder = Store::<C>::builder(url).pool_size(2).run_migrations(false);
    if let Some(schema) = &global.schema {
        builder = builder.schema(schema.clone());
    }
    let built = if checked {
        builder.build()
    } else {
        builder.build_unchecked()
    };
    built.map_err(|e| match e {
        inbox_diesel::Error::SchemaMismatch { .. } | inbox_diesel::Error::OperatorSchema { .. } => {
            Failure::new(exit::SCHEMA, e.to_string())
        }
        // `--schema` (the only setting an operator gives the builder) refused before
        // connecting: a bad argument.
        inbox_diesel::Error::InvalidSchemaName(_) | inbox_diesel::Error::InvalidSetting { .. } => {
            Failure::new(exit::USAGE, format!("--schema (INBOX_SCHEMA): {e}"))
        }
        other => failed(other),
    })
}

fn on_store<C: StoreConnection>(
    global: &GlobalArgs,
    url: &str,
    command: &Command,
    out: &mut dyn Write,
) -> Outcome {
    if let Command::Verify(args) = command {
        let store = open::<C>(global, url, false)?;
        return verify(global, &store, args, out);
    }
    let store = open::<C>(global, url, true)?;
    let target = ReplayTarget::with_prefix(global.prefix.clone());
    match command {
        Command::DeadLetters(cmd) => dead_letters(global, &store, &target, cmd, out),
        Command::Claims(cmd) => claims(global, &store, &target, cmd, out),
        Command::Groups(cmd) => groups(global, &store, cmd, out),
        Command::Stats => stats(global, &store, out),
        Command::Purge(args) => purge(global, &store, args, out),
        Command::Selftest(args) => crate::selftest::run(global, &store, args, out),
        Command::Verify(_) => Ok(()),
    }
}

pub(crate) fn print(out: &mut dyn Write, text: impl std::fmt::Display) -> Outcome {
    write!(out, "{text}").map_err(failed)
}

pub(crate) fn print_json(out: &mut dyn Write, value: &Value) -> Outcome {
    writeln!(out, "{}", output::json_text(value)).map_err(failed)
}

/// RFC 3339, or a duration ago.
fn parse_time(text: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, Failure> {
    if let Ok(at) = DateTime::parse_from_rfc3339(text) {
        return Ok(at.with_timezone(&Utc));
    }
    let ago = parse_duration(text).map_err(|_| {
        Failure::new(
            exit::USAGE,
            format!("expected an RFC 3339 time or a duration ago (1h, 2d), found {text:?}"),
        )
    })?;
    chrono::TimeDelta::from_std(ago)
        .ok()
        .and_then(|d| now.checked_sub_signed(d))
        .ok_or_else(|| Failure::new(exit::USAGE, format!("{text:?} reaches before the calendar")))
}

pub(crate) fn duration_arg(text: &str, what: &str) -> Result<Duration, Failure> {
    parse_duration(text).map_err(|e| Failure::new(exit::USAGE, format!("--{what}: {e}")))
}

fn filter<C: StoreConnection>(
    store: &Store<C>,
    args: &FilterArgs,
    default: StatusArg,
) -> Result<DeadLetterFilter, Failure> {
    let now = store.clock().now();
    let mut f = DeadLetterFilter::default();
    f.consumer_group.clone_from(&args.consumer_group);
    f.reason.clone_from(&args.reason);
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

fn dead_letters<C: StoreConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    target: &ReplayTarget,
    command: &DeadLetterCommand,
    out: &mut dyn Write,
) -> Outcome {
    match command {
        DeadLetterCommand::List {
            filter: args,
            limit,
            offset,
        } => {
            let f = filter(store, args, StatusArg::Active)?;
            let letters = store
                .list_dead_letters(&f, *offset, *limit)
                .map_err(failed)?;
            if global.json {
                let rows: Vec<Value> = letters.iter().map(output::entry_json).collect();
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
                    e.reason.clone(),
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
        DeadLetterCommand::Show { id } => {
            let details = store
                .dead_letter_details(*id)
                .map_err(failed)?
                .ok_or_else(|| Failure::new(exit::NOT_FOUND, format!("no dead letter {id}")))?;
            if global.json {
                return print_json(out, &output::details_json(&details));
            }
            print(out, output::details_text(&details))
        }
        DeadLetterCommand::Groups { filter: args } => {
            let f = filter(store, args, StatusArg::Pending)?;
            let groups = store.failure_groups(&f).map_err(failed)?;
            if global.json {
                let rows: Vec<Value> = groups.iter().map(output::group_json).collect();
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
                    g.reason.clone(),
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
        DeadLetterCommand::Replay {
            id,
            filter: args,
            limit,
            yes,
        } => {
            if let Some(id) = id {
                return replay_one(global, store, target, *id, out);
            }
            let f = filter(store, args, StatusArg::Pending)?;
            confirm(store, &f, *limit, *yes, "replay")?;
            let report = store
                .replay_dead_letters(&f, *limit, target)
                .map_err(failed)?;
            if global.json {
                return print_json(
                    out,
                    &json!({
                        "matched": report.matched,
                        "replayed": report.affected,
                        "refused": report.refused,
                        "skipped": report.skipped,
                    }),
                );
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
        DeadLetterCommand::Discard {
            id,
            filter: args,
            limit,
            yes,
        } => {
            if let Some(id) = id {
                let outcome = store.discard_dead_letter(*id).map_err(failed)?;
                let name = match outcome {
                    DiscardOutcome::Discarded => "discarded",
                    DiscardOutcome::AlreadyDiscarded => "already_discarded",
                    _ => "not_found",
                };
                if global.json {
                    print_json(out, &json!({ "id": id, "outcome": name }))?;
                } else {
                    print(
                        out,
                        format!("dead letter {id}: {}\n", name.replace('_', " ")),
                    )?;
                }
                return if name == "not_found" {
                    Err(Failure::new(exit::NOT_FOUND, format!("no dead letter {id}")).reported())
                } else {
                    Ok(())
                };
            }
            let f = filter(store, args, StatusArg::Pending)?;
            confirm(store, &f, *limit, *yes, "discard")?;
            let report = store.discard_dead_letters(&f, *limit).map_err(failed)?;
            if global.json {
                return print_json(
                    out,
                    &json!({
                        "matched": report.matched,
                        "discarded": report.affected,
                        "skipped": report.skipped,
                    }),
                );
            }
            print(
                out,
                format!(
                    "discarded {} of {} dead letters\n",
                    report.affected, report.matched
                ),
            )
        }
    }
}

/// A bulk change needs --yes; without it, says how many letters it would touch.
fn confirm<C: StoreConnection>(
    store: &Store<C>,
    f: &DeadLetterFilter,
    limit: Option<usize>,
    yes: bool,
    what: &str,
) -> Outcome {
    if yes {
        return Ok(());
    }
    let n = store
        .list_dead_letters(f, 0, limit.unwrap_or(usize::MAX))
        .map_err(failed)?
        .len();
    Err(Failure::new(
        exit::USAGE,
        format!("refusing to {what} {n} dead letters without --yes"),
    ))
}

fn replay_one<C: StoreConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    target: &ReplayTarget,
    id: i64,
    out: &mut dyn Write,
) -> Outcome {
    let outcome = store.replay_dead_letter(id, target).map_err(failed)?;
    let (value, text, failure) = match &outcome {
        ReplayOutcome::Replayed {
            sequence,
            outbox_id,
        } => (
            json!({ "id": id, "outcome": "replayed", "sequence": sequence, "outbox_id": outbox_id }),
            format!("dead letter {id}: replayed (replay {sequence}, outbox row {outbox_id})\n"),
            None,
        ),
        ReplayOutcome::Refused { reason, advice } => (
            json!({ "id": id, "outcome": "refused", "reason": reason, "advice": advice }),
            format!("dead letter {id}: refused ({reason}): {advice}\n"),
            Some(Failure::new(
                exit::REFUSED,
                format!("dead letter {id} is not replayable ({reason})"),
            )),
        ),
        ReplayOutcome::ClaimNotDead { status } => {
            let status = status.map_or("none", |s| s.as_str());
            (
                json!({ "id": id, "outcome": "claim_not_dead", "claim_status": status }),
                format!(
                    "dead letter {id}: nothing enqueued: its claim is {status}, not dead (replayed already?)\n"
                ),
                None,
            )
        }
        ReplayOutcome::Discarded => (
            json!({ "id": id, "outcome": "discarded" }),
            format!("dead letter {id}: discarded, not replayed\n"),
            Some(Failure::new(
                exit::REFUSED,
                format!("dead letter {id} is discarded"),
            )),
        ),
        _ => (
            json!({ "id": id, "outcome": "not_found" }),
            format!("no dead letter {id}\n"),
            Some(Failure::new(
                exit::NOT_FOUND,
                format!("no dead letter {id}"),
            )),
        ),
    };
    if global.json {
        print_json(out, &value)?;
    } else {
        print(out, text)?;
    }
    failure.map_or(Ok(()), |f| Err(f.reported()))
}

fn claims<C: StoreConnection>(
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
            let claims: Vec<_> = store
                .claims_for_key(key)
                .map_err(failed)?
                .into_iter()
                .filter(|c| consumer_group.as_ref().is_none_or(|g| *g == c.group))
                .collect();
            if global.json {
                let rows: Vec<Value> = claims.iter().map(output::claim_json).collect();
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
            let report = store
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

fn groups<C: StoreConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    command: &GroupCommand,
    out: &mut dyn Write,
) -> Outcome {
    match command {
        GroupCommand::List => {
            let halted = store.list_halted_groups().map_err(failed)?;
            if global.json {
                let rows: Vec<Value> = halted.iter().map(output::halt_json).collect();
                return print_json(out, &json!({ "halted": rows }));
            }
            print(out, output::halts_text(&halted))
        }
        GroupCommand::Resume { group } => {
            ConsumerGroup::new(group).map_err(|e| Failure::new(exit::USAGE, e.to_string()))?;
            let resumed = store.resume_group(group).map_err(failed)?;
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

fn stats<C: StoreConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    out: &mut dyn Write,
) -> Outcome {
    let s = store.operator_stats().map_err(failed)?;
    if global.json {
        return print_json(out, &output::stats_json(&s));
    }
    print(out, output::stats_text(&s))
}

fn purge<C: StoreConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    args: &PurgeArgs,
    out: &mut dyn Write,
) -> Outcome {
    let retention = Retention::new(
        duration_arg(&args.published, "published")?,
        duration_arg(&args.done_claims, "done-claims")?,
        duration_arg(&args.longest_retry, "longest-retry")?,
    )
    .map_err(|e| Failure::new(exit::USAGE, e.to_string()))?;
    let discarded = duration_arg(&args.discarded, "discarded")?;
    if args.batch == 0 {
        return Err(Failure::new(exit::USAGE, "--batch must be at least 1"));
    }
    let report = if args.dry_run {
        store
            .count_purgeable(&retention, discarded)
            .map_err(failed)?
    } else {
        let mut r = inbox_diesel::PurgeReport::default();
        r.published_outbox_rows = store
            .purge_published(&retention, args.batch)
            .map_err(failed)?;
        r.done_claims = store
            .purge_done_claims(&retention, args.batch)
            .map_err(failed)?;
        r.discarded_dead_letters = store
            .purge_discarded_dead_letters(discarded, args.batch)
            .map_err(failed)?;
        r
    };
    if global.json {
        return print_json(
            out,
            &json!({
                "dry_run": args.dry_run,
                "published_outbox_rows": report.published_outbox_rows,
                "done_claims": report.done_claims,
                "discarded_dead_letters": report.discarded_dead_letters,
            }),
        );
    }
    let verb = if args.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    print(
        out,
        format!(
            "{verb} {} published outbox rows, {} done claims, {} discarded dead letters\n",
            report.published_outbox_rows, report.done_claims, report.discarded_dead_letters
        ),
    )
}

fn verify<C: StoreConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    args: &VerifyArgs,
    out: &mut dyn Write,
) -> Outcome {
    let schema = store.verify_schema();
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
        text.push_str(&match &topology {
            None if args.amqp_url.is_none() => "topology: skipped (no AMQP_URL)\n".to_owned(),
            None => "topology: skipped (the schema failed)\n".to_owned(),
            Some(Ok(queues)) => format!("topology: ok ({} queues)\n", queues.len()),
            Some(Err(e)) => format!("topology: error: {}\n", escape(&e.to_string())),
        });
        print(out, text)?;
    }
    if let Some(e) = schema_error {
        return Err(Failure::new(exit::SCHEMA, e).reported());
    }
    if let Some(Err(e)) = topology {
        return Err(Failure::new(e.exit_code(), e.to_string()).reported());
    }
    Ok(())
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

/// A declare's failure: "not found" is a missing object, anything else the broker's.
fn declare_error(what: String, err: &lapin::Error, amqp_url: &str) -> TopologyError {
    let text = format!("{what}: {}", redact_message(&err.to_string(), amqp_url));
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) if e.get_id() == 404 => TopologyError::Missing(text),
        _ => TopologyError::Failed(text),
    }
}

/// Passive declares of the exchange and of every group's queue, dead-letter queue and
/// retry tiers; returns the queues checked. Errors name the object, never the URL.
fn check_topology<C: StoreConnection>(
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
        groups = store
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
    let queues = topology.queues();
    let exchange = args.exchange.as_ref().map(|_| topology.exchange());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| TopologyError::Failed(e.to_string()))?;
    let broker = |what: &str, e: lapin::Error| {
        TopologyError::Failed(format!(
            "{what}: {}",
            redact_message(&e.to_string(), amqp_url)
        ))
    };
    runtime.block_on(async {
        // The consumer's rules: `amqps://` with the feature `rustls`, the CA of
        // --ca-cert / AMQP_CA_CERT, no password in any error. A refused connection or
        // login is the broker's failure, not a topology that does not match.
        let conn = inbox_amqp::connect(amqp_url, args.ca_cert.as_deref())
            .await
            .map_err(|e| {
                TopologyError::Failed(format!("broker: {}", inbox_core::ErrorChain(&e)))
            })?;
        if let Some(exchange) = &exchange {
            let channel = conn
                .create_channel()
                .await
                .map_err(|e| broker("channel", e))?;
            channel
                .exchange_declare(
                    exchange.as_str().into(),
                    lapin::ExchangeKind::Topic,
                    lapin::options::ExchangeDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
                .map_err(|e| declare_error(format!("exchange {exchange:?}"), &e, amqp_url))?;
            let _ = channel.close(200, "verified".into()).await;
        }
        for queue in &queues {
            // A failed passive declare closes its channel: one channel per queue.
            let channel = conn
                .create_channel()
                .await
                .map_err(|e| broker("channel", e))?;
            channel
                .queue_declare(
                    queue.as_str().into(),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
                .map_err(|e| declare_error(format!("queue {queue:?}"), &e, amqp_url))?;
            let _ = channel.close(200, "verified".into()).await;
        }
        let _ = conn.close(200, "verified".into()).await;
        Ok::<_, TopologyError>(())
    })?;
    Ok(queues)
}
