//! What `verify_schema` checks of the operator migration's objects: outbox rows unique
//! by exactly (message_key, replay_seq), and nothing unique on less (the key alone
//! would refuse a replay, which keeps the original key); the dead-letter columns
//! replays and discards write, and the stored failure group with its index (and the
//! activity counts' indexes); the canary and group-halt tables; the replay
//! sequences' counters. Each table is read by the backend's one catalog read and
//! checked by the rules of `verify` every table shares.

use crate::backend::StoreConnection;
use crate::verify::{check_key, require_columns, require_index, Key, ReadIndex};
use crate::{Backend, Result, SchemaPart};

/// The outbox's key once replays exist: a replay of a message is another row with
/// the same message key and the next replay sequence. `id` is the database's own.
const OUTBOX: Key = Key {
    part: SchemaPart::Operator,
    columns: &["message_key", "replay_seq"],
    generated: &["id"],
};

/// The tables of the operator migration and the columns its statements need.
const REQUIRED: &[(&str, &[&str])] = &[
    (
        "inbox_canary",
        &["run_id", "seq", "sent_at", "arrived_at", "arrivals"],
    ),
    (
        "inbox_group_halts",
        &["consumer_group", "message_key", "detail", "halted_at"],
    ),
    ("inbox_replay_sequences", &["message_key", "last_seq"]),
    (
        "inbox_rebuild_reports",
        &[
            "id",
            "projection",
            "kind",
            "started_at",
            "finished_at",
            "outcome",
            "error",
            "drift_sample",
        ],
    ),
    (
        "inbox_dead_letters",
        &[
            "replay_count",
            "discarded_at",
            "payload_length",
            "payload_sha256",
            "failure_group",
        ],
    ),
];

/// The indexes the operator's reads stand on, by table: the failure groups' filter
/// and grouping, the activity counts' ranges per group.
const INDEXES: &[(&str, ReadIndex)] = &[
    (
        "inbox_rebuild_reports",
        ReadIndex {
            name: "inbox_rebuild_reports_recent",
            columns: &["projection", "id"],
            partial: false,
        },
    ),
    (
        "inbox_dead_letters",
        ReadIndex {
            name: "inbox_dead_letters_failure_group",
            columns: &["failure_group", "dead_lettered_at", "id"],
            partial: false,
        },
    ),
    (
        "inbox_dead_letters",
        ReadIndex {
            name: "inbox_dead_letters_by_group",
            columns: &["consumer_group", "dead_lettered_at"],
            partial: false,
        },
    ),
];

/// The activity counts' index of done claims per group: partial on PostgreSQL (the
/// groups are found on the primary key), whole on SQLite, whose claim key starts
/// with `message_key`, so the index also finds the groups.
fn done_by_group(backend: Backend) -> ReadIndex {
    match backend {
        Backend::Postgres => ReadIndex {
            name: "inbox_claims_done_by_group",
            columns: &["consumer_group", "updated_at"],
            partial: true,
        },
        Backend::Sqlite => ReadIndex {
            name: "inbox_claims_done_by_group",
            columns: &["consumer_group", "status", "updated_at"],
            partial: false,
        },
    }
}

/// Refuses a schema whose outbox cannot hold replays exactly once, or whose operator
/// tables, dead-letter columns or read indexes are missing.
pub(crate) fn check<C: StoreConnection>(conn: &mut C) -> Result<()> {
    check_key(&C::catalog(conn, "outbox_messages")?, OUTBOX)?;
    for (table, columns) in REQUIRED {
        require_columns(&C::catalog(conn, table)?, SchemaPart::Operator, columns)?;
    }
    for (table, index) in INDEXES {
        require_index(&C::catalog(conn, table)?, SchemaPart::Operator, *index)?;
    }
    require_index(
        &C::catalog(conn, "inbox_claims")?,
        SchemaPart::Operator,
        done_by_group(C::BACKEND),
    )?;
    Ok(())
}
