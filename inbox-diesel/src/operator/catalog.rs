//! What `verify_schema` checks of the operator migration's objects: outbox rows unique
//! by (message_key, replay_seq), and nothing unique on the key alone (a replay keeps
//! the original key, and would be refused); the dead-letter columns replays and
//! discards write; the canary and group-halt tables; the replay sequences' counters.

use diesel::result::QueryResult;

use crate::{Error, Result, SchemaPart, SchemaProblem};

/// One unique index of `outbox_messages`.
#[derive(Debug)]
pub struct UniqueIndex {
    pub name: String,
    pub partial: bool,
    pub columns: Vec<Option<String>>,
}

/// The live catalog, as the check needs it.
#[derive(Debug, Default)]
pub struct OperatorCatalog {
    /// The outbox table's name as the store sees it.
    pub outbox_table: String,
    /// (column, not null) of `outbox_messages`.
    pub outbox_columns: Vec<(String, bool)>,
    pub outbox_unique: Vec<UniqueIndex>,
    pub dead_letter_table: String,
    /// Columns of `inbox_dead_letters`.
    pub dead_letter_columns: Vec<String>,
    pub canary_table: String,
    /// Columns of `inbox_canary`.
    pub canary_columns: Vec<String>,
    pub halt_table: String,
    /// Columns of `inbox_group_halts`.
    pub halt_columns: Vec<String>,
    pub sequence_table: String,
    /// Columns of `inbox_replay_sequences`.
    pub sequence_columns: Vec<String>,
}

/// Reads the catalog; per backend.
pub trait CatalogOps: crate::backend::StoreConnection {
    /// Reads what [`check`] needs.
    #[doc(hidden)]
    fn op_catalog(conn: &mut Self) -> QueryResult<OperatorCatalog>;
}

fn describe(index: &UniqueIndex) -> String {
    let cols: Vec<&str> = index
        .columns
        .iter()
        .map(|c| c.as_deref().unwrap_or("<expression>"))
        .collect();
    format!(
        "{}unique ({}) [{}]",
        if index.partial { "partial " } else { "" },
        cols.join(", "),
        index.name
    )
}

fn has_columns(index: &UniqueIndex, wanted: &[&str]) -> bool {
    index.columns.len() == wanted.len()
        && wanted
            .iter()
            .all(|w| index.columns.iter().any(|c| c.as_deref() == Some(*w)))
}

/// Refuses a schema whose outbox cannot hold replays exactly once, or whose dead
/// letters lack the replay and discard columns.
pub(crate) fn check(catalog: &OperatorCatalog) -> Result<()> {
    let mismatch = |table: &str, problem: SchemaProblem, expected: &str, found: String| {
        Error::SchemaMismatch {
            part: SchemaPart::Operator,
            problem,
            expected: expected.to_owned(),
            found,
            table: table.to_owned(),
        }
    };
    // A required column of a table, or the table itself, is missing.
    let missing = |table: &str, expected: &str, no_table: bool| {
        let (problem, found) = if no_table {
            (
                SchemaProblem::MissingTable,
                "no such table (were the migrations run?)",
            )
        } else {
            (
                SchemaProblem::MissingColumn,
                "no such column (were the migrations run?)",
            )
        };
        mismatch(table, problem, expected, found.to_owned())
    };
    let outbox = &catalog.outbox_table;
    if catalog.outbox_columns.is_empty() {
        return Err(missing(outbox, "table outbox_messages", true));
    }
    match catalog
        .outbox_columns
        .iter()
        .find(|(n, _)| n == "replay_seq")
    {
        None => return Err(missing(outbox, "NOT NULL column replay_seq", false)),
        Some((_, false)) => {
            return Err(mismatch(
                outbox,
                SchemaProblem::NullableColumn,
                "NOT NULL column replay_seq",
                "nullable column replay_seq".to_owned(),
            ))
        }
        Some(_) => {}
    }
    if let Some(alone) = catalog
        .outbox_unique
        .iter()
        .find(|i| has_columns(i, &["message_key"]))
    {
        return Err(mismatch(
            outbox,
            SchemaProblem::ExtraUniqueIndex,
            "no unique index on message_key alone (a replay keeps the message key)",
            describe(alone),
        ));
    }
    let key_replay = ["message_key", "replay_seq"];
    if !catalog
        .outbox_unique
        .iter()
        .any(|i| !i.partial && has_columns(i, &key_replay))
    {
        let found: Vec<String> = catalog.outbox_unique.iter().map(describe).collect();
        return Err(mismatch(
            outbox,
            SchemaProblem::NoClaimIndex,
            "unique (message_key, replay_seq)",
            if found.is_empty() {
                "no unique index".to_owned()
            } else {
                found.join(", ")
            },
        ));
    }
    for column in ["run_id", "seq", "sent_at", "arrived_at", "arrivals"] {
        if !catalog.canary_columns.iter().any(|c| c == column) {
            return Err(missing(
                &catalog.canary_table,
                &format!("table inbox_canary with column {column}"),
                catalog.canary_columns.is_empty(),
            ));
        }
    }
    for column in ["consumer_group", "message_key", "detail", "halted_at"] {
        if !catalog.halt_columns.iter().any(|c| c == column) {
            return Err(missing(
                &catalog.halt_table,
                &format!("table inbox_group_halts with column {column}"),
                catalog.halt_columns.is_empty(),
            ));
        }
    }
    for column in ["message_key", "last_seq"] {
        if !catalog.sequence_columns.iter().any(|c| c == column) {
            return Err(missing(
                &catalog.sequence_table,
                &format!("table inbox_replay_sequences with column {column}"),
                catalog.sequence_columns.is_empty(),
            ));
        }
    }
    for column in [
        "replay_count",
        "discarded_at",
        "payload_length",
        "payload_sha256",
    ] {
        if !catalog.dead_letter_columns.iter().any(|c| c == column) {
            return Err(missing(
                &catalog.dead_letter_table,
                &format!("column {column}"),
                catalog.dead_letter_columns.is_empty(),
            ));
        }
    }
    Ok(())
}
