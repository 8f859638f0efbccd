//! `rebuild-reports`: the stored reports of projection rebuilds and audits.

use std::io::Write;

use inbox_diesel::operator::{Operator, OperatorConnection};
use inbox_diesel::Store;
use serde_json::json;

use crate::args::GlobalArgs;
use crate::failure::{failed, Outcome};
use crate::output::{self, print, print_json, Table};

pub(crate) fn rebuild_reports<C: OperatorConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    projection: Option<&str>,
    limit: usize,
    out: &mut dyn Write,
) -> Outcome {
    let reports = Operator::new(store)
        .rebuild_reports(projection, limit)
        .map_err(failed)?;
    if global.json {
        let rows = serde_json::to_value(&reports).map_err(failed)?;
        return print_json(out, &json!({ "rebuild_reports": rows }));
    }
    let mut table = Table::new([
        "ID",
        "FINISHED_AT",
        "PROJECTION",
        "KIND",
        "OUTCOME",
        "PARTITIONS",
        "ROWS_DIFFERING",
        "ROWS_CHANGED",
        "EVENTS_COVERED",
        "DURATION_MS",
        "ERROR",
    ]);
    for r in &reports {
        table.row([
            r.id.to_string(),
            output::time(r.finished_at),
            r.projection.clone(),
            r.kind.as_str().to_owned(),
            r.outcome.as_str().to_owned(),
            r.partitions.to_string(),
            r.rows_differing.to_string(),
            r.rows_changed.to_string(),
            r.events_covered.to_string(),
            r.duration_ms.to_string(),
            output::first_line(r.error.as_deref()),
        ]);
    }
    print(out, table.render(&format!("{} reports", reports.len())))
}
