//! `purge`: retention's delete, or its dry-run count.

use std::io::Write;

use inbox_diesel::operator::Operator;
use inbox_diesel::operator::OperatorConnection;
use inbox_diesel::{Retention, Store};
use serde_json::json;

use crate::args::{GlobalArgs, PurgeArgs};
use crate::commands::duration_arg;
use crate::exit;
use crate::failure::{failed, Failure, Outcome};
use crate::output::{print, print_json};

pub(crate) fn purge<C: OperatorConnection>(
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
        Operator::new(store)
            .count_purgeable(&retention, discarded)
            .map_err(failed)?
    } else {
        let mut r = inbox_diesel::operator::PurgeReport::default();
        r.published_outbox_rows = store
            .purge_published(&retention, args.batch)
            .map_err(failed)?;
        r.done_claims = store
            .purge_done_claims(&retention, args.batch)
            .map_err(failed)?;
        r.discarded_dead_letters = Operator::new(store)
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
