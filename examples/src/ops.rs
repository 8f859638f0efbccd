//! The operator commands of the usage projection, as clap subcommands: `usage_ops`
//! mounts them (`audit daily_usage --days N`, `rebuild daily_usage --days N`), and
//! `usage_consumer` takes its rebuild schedule through [`ScheduleArgs`].

use std::fmt::Write as _;
use std::time::Duration;

use clap::{Args, Subcommand};
use inbox_core::rebuild::{AuditReport, DriftRow, RebuildReport};
use inbox_diesel::rebuild::RebuildConnection;
use inbox_diesel::rebuild::Rebuilder;
use inbox_diesel::Store;

/// The projection commands (`usage_ops audit|rebuild <projection> --days N`; the
/// binary's global `--json` picks the output).
#[derive(Clone, Debug, Subcommand)]
pub enum ProjectionCommand {
    /// Compare a window of a projection with its recomputation from the ledger and
    /// print the drift; writes nothing.
    Audit(WindowArgs),
    /// Recompute a window of a projection from the ledger and replace it, a day per
    /// transaction, while live consumers run; print what changed.
    Rebuild(WindowArgs),
}

/// Which projection, which window, which output.
#[derive(Clone, Debug, Args)]
pub struct WindowArgs {
    /// The projection (`daily_usage`).
    pub projection: String,
    /// The window: today (UTC) and the N-1 days before it.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=3660))]
    pub days: u32,
}

impl ProjectionCommand {
    /// Runs the command on `store`; returns what to print on stdout: the report as one
    /// JSON object (stable field names) when `json`, else as text.
    pub fn run<C: RebuildConnection>(
        &self,
        store: &Store<C>,
        json: bool,
    ) -> Result<String, inbox_diesel::Error> {
        match self {
            Self::Audit(args) => {
                let report = Rebuilder::new(store, &args.projection)?.audit(args.days)?;
                Ok(if json {
                    to_json(&report)
                } else {
                    audit_text(&report)
                })
            }
            Self::Rebuild(args) => {
                let report = Rebuilder::new(store, &args.projection)?.rebuild(args.days)?;
                Ok(if json {
                    to_json(&report)
                } else {
                    rebuild_text(&report)
                })
            }
        }
    }
}

fn to_json<T: serde::Serialize>(report: &T) -> String {
    // A report is plain numbers and strings: it always serializes.
    serde_json::to_string(report).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

fn ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "none".to_owned(), |r| format!("{r:.2}"))
}

fn figure(f: Option<f64>) -> String {
    f.map_or_else(|| "none".to_owned(), |f| f.to_string())
}

fn sample_lines(out: &mut String, sample: &[DriftRow]) {
    for row in sample {
        let _ = writeln!(
            out,
            "  {} {}: projected {}, recomputed {}",
            row.partition,
            row.row,
            figure(row.projected),
            figure(row.recomputed)
        );
    }
}

/// An audit as text: one summary line, then the sample of differing rows.
pub fn audit_text(r: &AuditReport) -> String {
    let mut out = format!(
        "audit {}: {} partitions, {} rows checked, {} differing ({} extra), largest ratio {}, {} ms\n",
        r.projection,
        r.partitions,
        r.rows_checked,
        r.rows_differing,
        r.extra_rows,
        ratio(r.largest_ratio),
        r.duration_ms
    );
    sample_lines(&mut out, &r.sample);
    out
}

/// A rebuild as text: one summary line, then the rows it changed, as they were.
pub fn rebuild_text(r: &RebuildReport) -> String {
    let mut out = format!(
        "rebuild {}: {} partitions, {} rows changed, {} events covered \
         ({} claims recorded, {} converted, {} dead covered, {} dead letters resolved), \
         drift found {} rows ({} extra, largest ratio {}), {} lock waits, {} lock timeouts, {} ms\n",
        r.projection,
        r.partitions,
        r.rows_changed,
        r.events_covered,
        r.claims_recorded,
        r.claims_converted,
        r.dead_covered,
        r.dead_letters_resolved,
        r.rows_differing,
        r.extra_rows,
        ratio(r.largest_ratio),
        r.lock_waits,
        r.lock_timeouts,
        r.duration_ms
    );
    sample_lines(&mut out, &r.sample);
    out
}

/// The rebuild schedule of a consumer process.
#[derive(Clone, Debug, Args)]
pub struct ScheduleArgs {
    /// Rebuild the projection every interval beside consuming (`1h`, `30m`, `90s`,
    /// `500ms`); no scheduled rebuild when absent.
    #[arg(long, env = "INBOX_REBUILD_EVERY", value_parser = parse_duration)]
    pub rebuild_every: Option<Duration>,
    /// The scheduled rebuild's window: today (UTC) and the N-1 days before it.
    #[arg(long, env = "INBOX_REBUILD_DAYS", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=3660))]
    pub rebuild_days: u32,
}

/// Parses `1h`, `30m`, `90s`, `500ms` (a positive whole number and a unit).
///
/// ```
/// use std::time::Duration;
/// use inbox_examples::ops::parse_duration;
/// assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
/// assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
/// assert!(parse_duration("1.5h").is_err());
/// assert!(parse_duration("0s").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let refused = || {
        format!("expected a positive whole number and one of ms, s, m, h (e.g. 1h, 30m), found {text:?}")
    };
    let n: u64 = number.parse().map_err(|_| refused())?;
    if n == 0 {
        return Err(refused());
    }
    let secs = |per: u64| {
        n.checked_mul(per)
            .map(Duration::from_secs)
            .ok_or_else(refused)
    };
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => secs(1),
        "m" => secs(60),
        "h" => secs(3_600),
        _ => Err(refused()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_or_say_why_not() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        for bad in [
            "",
            "h",
            "1",
            "1d",
            "-1h",
            " 1h",
            "1 h",
            "99999999999999999999h",
        ] {
            let err = parse_duration(bad).unwrap_err();
            assert!(
                err.contains("expected a positive whole number"),
                "{bad}: {err}"
            );
        }
    }
}
