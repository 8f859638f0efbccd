//! Failure groups: dead letters that failed the same way share a fingerprint.
//!
//! The fingerprint is taken over the reason, the message type, the error's kind (the
//! outermost error's message: the first line's text before its first `:`) and the
//! error's first line, with numbers and ids masked: `order 4411 of user 17 failed`
//! and `order 982 of user 3 failed` are one group, `timeout` and `refused` two.
//!
//! Every dead letter stores its fingerprint in `inbox_dead_letters.failure_group`,
//! written by the one statement that inserts letters (`insert_dead_letter`, on every
//! path: a batch's dead letters, collisions, malformed deliveries, the broker's dead
//! letters, crash loops). Letters written before the column existed are filled by
//! [`backfill`], which each backend's migration step runs after the migrations.
//!
//! # The backfill, and two of them at once
//!
//! [`backfill`] reads letters `WHERE failure_group IS NULL` in id order, a bounded
//! batch at a time, and sets each batch's fingerprints in a transaction of its own,
//! `WHERE id IN (...) AND failure_group IS NULL`: it never rewrites a stored
//! fingerprint, a run that stops half way leaves filled batches filled, and a second
//! run finds nothing to do. On PostgreSQL it runs under the migration lock, so two
//! stores starting at once backfill one after the other; were two to run at once
//! anyway, the guard makes the later update of a row touch nothing (both compute the
//! same value), and the counts they log add up to the rows filled. A letter an older
//! binary inserts during a rolling upgrade has no fingerprint until the next store
//! build's backfill: the operator's grouping fingerprints such letters when it reads
//! them, its filter by failure group does not find them until then.

use diesel::connection::LoadConnection;
use diesel::dsl::{auto_type, update};
use diesel::prelude::*;
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::query_dsl::LoadQuery;
use sha2::{Digest, Sha256};

use crate::schema::inbox_dead_letters as dl;

/// What a dead letter's failure looks like once numbers and ids are masked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Signature {
    /// The error's kind, masked.
    pub kind: String,
    /// The error's first line, masked.
    pub line: String,
    /// 16 lower-case hex digits.
    pub fingerprint: String,
}

/// The signature of a failure.
pub(crate) fn signature(reason: &str, message_type: &str, last_error: Option<&str>) -> Signature {
    let first = last_error
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or_default()
        .trim();
    let line = mask(first);
    let kind = line.split(':').next().unwrap_or_default().trim().to_owned();
    let mut hash = Sha256::new();
    for part in [reason, message_type, &kind, &line] {
        hash.update(part.as_bytes());
        hash.update([0]);
    }
    let digest = hash.finalize();
    let fingerprint = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    Signature {
        kind,
        line,
        fingerprint,
    }
}

/// Letters a backfill batch reads and fills, in one transaction.
pub(crate) const BACKFILL_BATCH: i64 = 500;

/// Fills the failure group of every letter that has none, in batches of
/// [`BACKFILL_BATCH`] (a transaction each); returns how many it filled and logs the
/// count when there were any. Idempotent: see the module docs.
pub(crate) fn backfill<C>(conn: &mut C) -> crate::Result<u64>
where
    C: crate::StoreConnection + LoadConnection,
    unfilled: LoadQuery<'static, C, (i64, String, String, Option<String>)>,
    fill: ExecuteDsl<C>,
{
    let mut after = i64::MIN;
    let mut filled = 0_u64;
    loop {
        let (last, n) = C::write_transaction(conn, |conn| -> QueryResult<_> {
            let rows = unfilled(after, BACKFILL_BATCH).load(conn)?;
            let mut by_print: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
            for (id, reason, message_type, last_error) in &rows {
                let print = signature(reason, message_type, last_error.as_deref()).fingerprint;
                by_print.entry(print).or_default().push(*id);
            }
            let mut n = 0_usize;
            for (print, ids) in by_print {
                n += fill(ids, print).execute(conn)?;
            }
            Ok((rows.last().map(|r| r.0), n))
        })?;
        filled += n as u64;
        match last {
            Some(id) => after = id,
            None => break,
        }
    }
    if filled > 0 {
        tracing::info!(
            filled,
            "backfilled the failure group of dead letters written before it was stored"
        );
    }
    Ok(filled)
}

#[auto_type]
fn unfilled(after: i64, limit: i64) -> _ {
    dl::table
        .filter(dl::failure_group.is_null())
        .filter(dl::id.gt(after))
        .order(dl::id)
        .select((dl::id, dl::reason, dl::message_type, dl::last_error))
        .limit(limit)
}

#[auto_type]
fn fill(ids: Vec<i64>, print: String) -> _ {
    let value: Option<String> = Some(print);
    update(
        dl::table
            .filter(dl::id.eq_any(ids))
            .filter(dl::failure_group.is_null()),
    )
    .set(dl::failure_group.eq(value))
}

/// Masks ids (UUIDs, hex runs of 8 or more digits with a decimal digit in them) as
/// `<id>` and every other run of decimal digits as `<n>`.
pub(crate) fn mask(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        if is_uuid_at(&chars, i) {
            out.push_str("<id>");
            i += 36;
            continue;
        }
        if chars[i].is_ascii_alphanumeric() {
            let start = i;
            while i < chars.len() && chars[i].is_ascii_alphanumeric() {
                i += 1;
            }
            let word = &chars[start..i];
            let hex_id = word.len() >= 8
                && word.iter().all(char::is_ascii_hexdigit)
                && word.iter().any(char::is_ascii_digit);
            if hex_id {
                out.push_str("<id>");
            } else {
                mask_digits(word, &mut out);
            }
            continue;
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

fn mask_digits(word: &[char], out: &mut String) {
    let mut in_number = false;
    for c in word {
        if c.is_ascii_digit() {
            if !in_number {
                out.push_str("<n>");
                in_number = true;
            }
        } else {
            in_number = false;
            out.push(*c);
        }
    }
}

/// Whether a UUID (8-4-4-4-12 hex digits) starts at `i`, not inside a longer word.
fn is_uuid_at(chars: &[char], i: usize) -> bool {
    const GROUPS: [usize; 5] = [8, 4, 4, 4, 12];
    if i > 0 && chars[i - 1].is_ascii_alphanumeric() {
        return false;
    }
    let mut at = i;
    for (n, len) in GROUPS.iter().enumerate() {
        if n > 0 {
            if chars.get(at) != Some(&'-') {
                return false;
            }
            at += 1;
        }
        for _ in 0..*len {
            match chars.get(at) {
                Some(c) if c.is_ascii_hexdigit() => at += 1,
                _ => return false,
            }
        }
    }
    !chars.get(at).is_some_and(char::is_ascii_alphanumeric)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_ids_are_masked() {
        assert_eq!(
            mask("order 4411 of user 17 failed after 2.5s"),
            "order <n> of user <n> failed after <n>.<n>s"
        );
        assert_eq!(
            mask("key 0b3c2f1e-8a9d-5f4e-b3c2-1a0f9e8d7c6b is taken"),
            "key <id> is taken"
        );
        assert_eq!(
            mask("row deadbeef01 gone, k-7 too"),
            "row <id> gone, k-<n> too"
        );
        // Words that merely look like hex stay, so do words without digits.
        assert_eq!(mask("accepted facade"), "accepted facade");
        assert_eq!(mask("v2 http2"), "v<n> http<n>");
    }

    #[test]
    fn the_same_failure_with_other_numbers_is_one_group() {
        let a = signature(
            "max_attempts",
            "usage.recorded",
            Some("ledger row 17 locked: timeout after 30s\nstack"),
        );
        let b = signature(
            "max_attempts",
            "usage.recorded",
            Some("ledger row 9 locked: timeout after 5s"),
        );
        assert_eq!(a, b);
        assert_eq!(a.kind, "ledger row <n> locked");
        assert_eq!(a.line, "ledger row <n> locked: timeout after <n>s");
        assert_eq!(a.fingerprint.len(), 16);
    }

    #[test]
    fn reason_type_and_text_each_tell_groups_apart() {
        let base = signature("max_attempts", "usage.recorded", Some("timeout"));
        for other in [
            signature("permanent", "usage.recorded", Some("timeout")),
            signature("max_attempts", "usage.refunded", Some("timeout")),
            signature("max_attempts", "usage.recorded", Some("refused")),
            signature("max_attempts", "usage.recorded", None),
        ] {
            assert_ne!(base.fingerprint, other.fingerprint, "{other:?}");
        }
    }
}
