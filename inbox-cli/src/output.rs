//! Human tables, and the printing of the JSON documents (their field names are a
//! contract, defined once in `inbox_diesel::operator::json`: see the README).
//!
//! Every value a publisher controls (a key, type, tenant, header, error, payload) and
//! every stored text is shown through [`inbox_core::display::escape`]: control
//! characters (C0, DEL, C1), format characters (bidi overrides, zero-width) and line
//! separators are made visible, so nothing in a letter acts on the operator's terminal
//! and one record is one line. Tables escape every cell; `dead-letters show` escapes
//! every field, header and the payload. The JSON documents keep the values exactly and
//! write those characters as `\u` escapes ([`json_text`]).

use std::fmt::Write as _;
use std::io;

use chrono::{DateTime, SecondsFormat, Utc};
use inbox_core::display::{escape, is_escaped};
use inbox_diesel::operator::{Activity, Count, DeadLetterDetails, HaltedGroup, OperatorStats};
use serde_json::Value;

use crate::failure::{failed, Outcome};

/// Columns padded to their widest cell.
pub(crate) struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new<const N: usize>(header: [&str; N]) -> Self {
        Self {
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub(crate) fn row<const N: usize>(&mut self, cells: [String; N]) {
        self.rows
            .push(cells.into_iter().map(|c| one_line(&c)).collect());
    }

    /// The table, or `(none)`, then a summary line.
    pub(crate) fn render(&self, summary: &str) -> String {
        let mut out = String::new();
        if self.rows.is_empty() {
            let _ = writeln!(out, "(none)");
        } else {
            let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
            for row in &self.rows {
                for (w, cell) in widths.iter_mut().zip(row) {
                    *w = (*w).max(cell.chars().count());
                }
            }
            for row in std::iter::once(&self.header).chain(&self.rows) {
                let last = row.len().saturating_sub(1);
                let mut line = String::new();
                for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
                    if i == last {
                        line.push_str(cell);
                    } else {
                        let _ = write!(line, "{cell:<w$}  ");
                    }
                }
                let _ = writeln!(out, "{}", line.trim_end());
            }
        }
        let _ = writeln!(out, "{summary}");
        out
    }
}

/// A value as one line of human output.
fn one_line(s: &str) -> String {
    escape(s).into_owned()
}

/// JSON whose strings write every character [`escape`] would make visible as a
/// `\uXXXX` escape: the same document for a parser, inert bytes for a terminal.
struct InertJson;

impl serde_json::ser::Formatter for InertJson {
    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        let mut rest = fragment;
        while let Some(at) = rest.find(|c| c != '\\' && is_escaped(c)) {
            writer.write_all(&rest.as_bytes()[..at])?;
            let c = rest[at..].chars().next().unwrap_or_default();
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                write!(writer, "\\u{unit:04x}")?;
            }
            rest = &rest[at + c.len_utf8()..];
        }
        writer.write_all(rest.as_bytes())
    }
}

/// A JSON document as one line of inert text (see [`InertJson`]).
pub(crate) fn json_text(value: &Value) -> String {
    let mut bytes = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(&mut bytes, InertJson);
    match serde::Serialize::serialize(value, &mut serializer) {
        // The formatter writes only ASCII escapes and the value's own UTF-8.
        Ok(()) => String::from_utf8(bytes).unwrap_or_else(|_| value.to_string()),
        Err(_) => value.to_string(),
    }
}

/// A time as RFC 3339 in UTC, to the second.
pub(crate) fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// The first line of an error, at most 80 characters.
pub(crate) fn first_line(text: Option<&str>) -> String {
    let line = text.unwrap_or_default().lines().next().unwrap_or_default();
    if line.chars().count() > 80 {
        let cut: String = line.chars().take(77).collect();
        format!("{cut}...")
    } else {
        line.to_owned()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

pub(crate) fn details_text(d: &DeadLetterDetails) -> String {
    let e = &d.entry;
    let mut out = String::new();
    let mut field = |name: &str, value: String| {
        let _ = writeln!(out, "{name:<20} {}", escape(&value));
    };
    field("id", e.id.to_string());
    field("consumer group", e.consumer_group.clone());
    field("message key", e.message_key.clone());
    field("message type", e.message_type.clone());
    field("tenant", e.tenant.clone().unwrap_or_else(|| "-".to_owned()));
    field("reason", e.reason.as_str().to_owned());
    field("status", e.status.as_str().to_owned());
    field("attempts", e.attempts.to_string());
    field("dead-lettered at", time(e.dead_lettered_at));
    field("first failure", time(d.first_failure_at));
    field("last failure", time(d.last_failure_at));
    field("replays", e.replay_count.to_string());
    field(
        "last replayed at",
        e.replayed_at.map_or_else(|| "-".to_owned(), time),
    );
    if let Some(n) = e.delivered_by_replay {
        field("delivered by replay", n.to_string());
    }
    field(
        "claim",
        d.claim_status.map_or("none", |s| s.as_str()).to_owned(),
    );
    field("failure group", e.failure_group.clone());
    if let Some(tp) = d.headers.get(inbox_core::TRACEPARENT_HEADER) {
        field("traceparent", tp.clone());
    }
    field(
        "replayable",
        match d.replay_refusal {
            None => "yes".to_owned(),
            Some(why) => format!("no: {why}"),
        },
    );
    field(
        "last error",
        e.last_error.clone().unwrap_or_else(|| "-".to_owned()),
    );
    let _ = writeln!(out, "headers:");
    if d.headers.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for (k, v) in &d.headers {
        let _ = writeln!(out, "  {}: {}", escape(k), escape(v));
    }
    let cut = d.payload_cut.map(|c| {
        format!(
            ", cut: the first of {} bytes, sha256 {}",
            c.length,
            hex(&c.sha256)
        )
    });
    let _ = writeln!(
        out,
        "payload ({} bytes{}):",
        d.payload.len(),
        cut.unwrap_or_default()
    );
    match std::str::from_utf8(&d.payload) {
        Ok(text) => {
            let _ = writeln!(out, "  {}", escape(text));
        }
        Err(_) => {
            let _ = writeln!(out, "  hex {}", hex(&d.payload));
        }
    }
    out
}

pub(crate) fn stats_text(s: &OperatorStats) -> String {
    let mut claims = Table::new([
        "GROUP",
        "STARTED",
        "DONE",
        "FAILED",
        "DEAD",
        "RETRIES_DUE",
        "RETRIES_WAITING",
        "OLDEST_PENDING_RETRY",
    ]);
    for g in &s.groups {
        claims.row([
            g.consumer_group.clone(),
            g.started.to_string(),
            g.done.to_string(),
            g.failed.to_string(),
            g.dead.to_string(),
            g.retries_due.to_string(),
            g.retries_waiting.to_string(),
            g.oldest_pending_retry.map_or_else(|| "-".to_owned(), time),
        ]);
    }
    let mut letters = Table::new(["GROUP", "REASON", "DEAD_LETTERS"]);
    for l in &s.dead_letters {
        letters.row([
            l.consumer_group.clone(),
            l.reason.as_str().to_owned(),
            l.count.to_string(),
        ]);
    }
    let age = s
        .oldest_unpublished_age
        .map_or_else(|| "-".to_owned(), |d| format!("{:.1}s", d.as_secs_f64()));
    format!(
        "claims\n{}\n{}pending dead letters\n{}\noutbox: {} unpublished (oldest {age}), {} dead\n",
        claims.render(&format!("{} groups", s.groups.len())),
        if s.halted.is_empty() {
            String::new()
        } else {
            format!("halted groups\n{}\n", halts_text(&s.halted))
        },
        letters.render(&format!(
            "{} pending dead letters",
            s.dead_letters.iter().map(|l| l.count).sum::<u64>()
        )),
        s.outbox_backlog,
        s.dead_outbox_rows
    )
}

/// A count as text: `N`, or `N+` when it is a lower bound (the read stopped at
/// its cap).
fn count_text(c: Count) -> String {
    if c.at_least {
        format!("{}+", c.count)
    } else {
        c.count.to_string()
    }
}

/// One line per group: processed and dead-lettered in the last hour and day.
pub(crate) fn activity_text(a: &Activity) -> String {
    let mut out = String::from("activity (last hour / last day)\n");
    if a.groups.is_empty() {
        out.push_str("(none)\n");
    }
    for g in &a.groups {
        let _ = writeln!(
            out,
            "{}: processed {} / {}, dead-lettered {} / {}",
            one_line(&g.consumer_group),
            count_text(g.processed_last_hour),
            count_text(g.processed_last_day),
            count_text(g.dead_lettered_last_hour),
            count_text(g.dead_lettered_last_day),
        );
    }
    out
}

pub(crate) fn halts_text(halted: &[HaltedGroup]) -> String {
    let mut table = Table::new(["HALTED_GROUP", "HALTED_AT", "KEY", "DETAIL"]);
    for h in halted {
        table.row([
            h.consumer_group.clone(),
            time(h.halted_at),
            h.message_key.clone(),
            first_line(Some(&h.detail)),
        ]);
    }
    table.render(&format!("{} halted groups", halted.len()))
}

pub(crate) fn print(out: &mut dyn io::Write, text: impl std::fmt::Display) -> Outcome {
    write!(out, "{text}").map_err(failed)
}

pub(crate) fn print_json(out: &mut dyn io::Write, value: &Value) -> Outcome {
    writeln!(out, "{}", json_text(value)).map_err(failed)
}
