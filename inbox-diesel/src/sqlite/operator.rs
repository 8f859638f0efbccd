//! SQLite's side of the operator tooling: its statements (the shared DSL of
//! `operator::ops`).

use diesel::prelude::*;
use diesel::result::QueryResult;

use chrono::{DateTime, Utc};

use crate::operator::ops::{
    EntryRow, FailureCount, FailureSample, OperatorOps, Redrivable, ScanRow, ScanWindow, Tally,
};
use crate::operator::{DeadLetterFilter, LetterStatus};

crate::operator::operator_ops!(diesel::SqliteConnection);

/// One group's bounded read of one tally: the newest `cap` timestamps of its index
/// range, bucketed in process by [`ScanWindow::tally`] (SQLite has no exact
/// arithmetic on its text timestamps; the rows never leave the process).
fn activity_scan(
    conn: &mut diesel::SqliteConnection,
    tally: Tally,
    group: &str,
    window: &ScanWindow,
) -> QueryResult<Vec<ScanRow>> {
    use crate::schema::Stamp;
    let times: Vec<DateTime<Utc>> = match tally {
        Tally::Processed => {
            use crate::schema::inbox_claims::dsl::*;
            inbox_claims
                .filter(consumer_group.eq(group))
                .filter(status.eq(crate::ClaimStatus::Done.as_str()))
                .filter(updated_at.ge(Stamp(window.from)))
                .filter(updated_at.lt(Stamp(window.now)))
                .order(updated_at.desc())
                .select(updated_at)
                .limit(window.cap)
                .load(conn)?
        }
        Tally::DeadLettered => {
            use crate::schema::inbox_dead_letters::dsl::*;
            inbox_dead_letters
                .filter(consumer_group.eq(group))
                .filter(dead_lettered_at.ge(Stamp(window.from)))
                .filter(dead_lettered_at.lt(Stamp(window.now)))
                .order(dead_lettered_at.desc())
                .select(dead_lettered_at)
                .limit(window.cap)
                .load(conn)?
        }
    };
    Ok(window.tally(&times))
}
