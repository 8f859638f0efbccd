//! The invariants over the current tables, and the summary: jobs by state, ledger sums,
//! balance per user.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use super::db::{JobRow, JobState, LedgerRow};

/// One violated invariant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// The job concerned.
    pub job_id: String,
    /// Which invariant: `one_charge`, `charge_amount`, `refund_amount`,
    /// `reclaim_amount`, `reclaim_without_refund`, `reclaim_before_refund`,
    /// `refund_flag`, `reclaim_flag`, `unknown_state`, `net`, `unknown_job`,
    /// `entry_type`.
    pub invariant: &'static str,
    /// What was expected and found.
    pub detail: String,
}

/// Count and sum of one entry type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Sums {
    /// Rows.
    pub rows: u64,
    /// Their amounts' sum.
    pub sum: i64,
}

/// What `check` reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    /// No invariant is violated.
    pub ok: bool,
    /// Jobs in the table.
    pub jobs: u64,
    /// Jobs per state (`delivered`, `failed`, `dead`, `queued`, `running`), every
    /// state present, 0 when none.
    pub by_state: BTreeMap<String, u64>,
    /// Jobs not yet terminal (`queued` or `running`).
    pub pending: u64,
    /// Ledger rows and sums per entry type (`charge`, `refund`, `reclaim`).
    pub ledger: BTreeMap<String, Sums>,
    /// The sum of the whole ledger.
    pub ledger_total: i64,
    /// The sum of the ledger per user (the balance; charges are negative).
    pub balance: BTreeMap<String, i64>,
    /// Every violation found.
    pub violations: Vec<Violation>,
}

/// Checks the invariants of the ledger over `jobs` and `ledger`:
///
/// - every job has exactly one charge, of `-cost`; at most one refund, of `+cost`; at
///   most one reclaim, of `-cost`, and only after a refund (a later ledger row);
/// - the guard flags agree with the ledger (`refunded` iff a refund row, `reclaimed`
///   iff a reclaim row);
/// - the net of a `delivered` job is `-cost`; of a `failed` or `dead` one `0`; of a
///   pending one `-cost` or (refunded, a retry due) `0`;
/// - every ledger row belongs to a job and has a known entry type.
pub fn check(jobs: &[JobRow], ledger: &[LedgerRow]) -> Report {
    let mut violations = Vec::new();
    let mut by_job: BTreeMap<&str, Vec<&LedgerRow>> = BTreeMap::new();
    let mut sums: BTreeMap<String, Sums> = ["charge", "refund", "reclaim"]
        .into_iter()
        .map(|t| (t.to_owned(), Sums::default()))
        .collect();
    let mut ledger_total = 0i64;
    for row in ledger {
        by_job.entry(row.job_id.as_str()).or_default().push(row);
        ledger_total = ledger_total.saturating_add(row.amount);
        match sums.get_mut(&row.entry_type) {
            Some(s) => {
                s.rows += 1;
                s.sum = s.sum.saturating_add(row.amount);
            }
            None => violations.push(Violation {
                job_id: row.job_id.clone(),
                invariant: "entry_type",
                detail: format!("ledger row {} has entry type {:?}", row.id, row.entry_type),
            }),
        }
    }
    let mut by_state: BTreeMap<String, u64> = JobState::ALL
        .into_iter()
        .map(|s| (s.as_str().to_owned(), 0))
        .collect();
    let mut balance: BTreeMap<String, i64> = BTreeMap::new();
    let mut pending = 0;
    for job in jobs {
        *by_state.entry(job.state.clone()).or_default() += 1;
        let rows = by_job.remove(job.job_id.as_str()).unwrap_or_default();
        let net: i64 = rows.iter().map(|r| r.amount).sum();
        *balance.entry(job.user_id.clone()).or_default() += net;
        let mut v = |invariant: &'static str, detail: String| {
            violations.push(Violation {
                job_id: job.job_id.clone(),
                invariant,
                detail,
            })
        };
        let of = |t: &str| {
            rows.iter()
                .filter(|r| r.entry_type == t)
                .collect::<Vec<_>>()
        };
        let (charges, refunds, reclaims) = (of("charge"), of("refund"), of("reclaim"));
        if charges.len() != 1 {
            v(
                "one_charge",
                format!("expected 1 charge, found {}", charges.len()),
            );
        }
        for (rows, want, invariant) in [
            (&charges, -job.cost, "charge_amount"),
            (&refunds, job.cost, "refund_amount"),
            (&reclaims, -job.cost, "reclaim_amount"),
        ] {
            for r in rows.iter().filter(|r| r.amount != want) {
                v(
                    invariant,
                    format!("ledger row {}: expected {want}, found {}", r.id, r.amount),
                );
            }
        }
        if refunds.len() > 1 || reclaims.len() > 1 {
            v(
                "one_charge",
                format!(
                    "expected at most one refund and one reclaim, found {} and {}",
                    refunds.len(),
                    reclaims.len()
                ),
            );
        }
        if let Some(reclaim) = reclaims.first() {
            match refunds.first() {
                None => v(
                    "reclaim_without_refund",
                    format!("reclaim row {} has no refund before it", reclaim.id),
                ),
                Some(refund) if refund.id > reclaim.id => v(
                    "reclaim_before_refund",
                    format!(
                        "reclaim row {} precedes refund row {}",
                        reclaim.id, refund.id
                    ),
                ),
                Some(_) => {}
            }
        }
        if job.refunded == refunds.is_empty() {
            v(
                "refund_flag",
                format!("refunded = {}, {} refund rows", job.refunded, refunds.len()),
            );
        }
        if job.reclaimed == reclaims.is_empty() {
            v(
                "reclaim_flag",
                format!(
                    "reclaimed = {}, {} reclaim rows",
                    job.reclaimed,
                    reclaims.len()
                ),
            );
        }
        let allowed: &[i64] = match JobState::parse(&job.state) {
            Some(JobState::Delivered) => &[-job.cost],
            Some(JobState::Failed | JobState::Dead) => &[0],
            Some(JobState::Queued | JobState::Running) => {
                pending += 1;
                &[-job.cost, 0]
            }
            None => {
                v("unknown_state", format!("state {:?}", job.state));
                &[]
            }
        };
        if !allowed.is_empty() && !allowed.contains(&net) {
            v(
                "net",
                format!(
                    "a {} job of cost {} must net {}, found {net}",
                    job.state,
                    job.cost,
                    allowed
                        .iter()
                        .map(i64::to_string)
                        .collect::<Vec<_>>()
                        .join(" or ")
                ),
            );
        }
    }
    for (job_id, rows) in by_job {
        violations.push(Violation {
            job_id: job_id.to_owned(),
            invariant: "unknown_job",
            detail: format!("{} ledger rows of a job that does not exist", rows.len()),
        });
    }
    Report {
        ok: violations.is_empty(),
        jobs: jobs.len() as u64,
        by_state,
        pending,
        ledger: sums,
        ledger_total,
        balance,
        violations,
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "jobs:           {} ({} pending)",
            self.jobs, self.pending
        )?;
        for (state, n) in &self.by_state {
            writeln!(f, "  {state:<13} {n}")?;
        }
        writeln!(f, "ledger:         total {}", self.ledger_total)?;
        for (entry, s) in &self.ledger {
            writeln!(f, "  {entry:<13} {} rows, sum {}", s.rows, s.sum)?;
        }
        writeln!(f, "balance:")?;
        for (user, b) in &self.balance {
            writeln!(f, "  {user:<13} {b}")?;
        }
        if self.ok {
            write!(f, "check:          ok, every invariant holds")
        } else {
            writeln!(f, "check:          {} VIOLATIONS", self.violations.len())?;
            for v in &self.violations {
                writeln!(f, "  job {}: {}: {}", v.job_id, v.invariant, v.detail)?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: &str, state: &str, refunded: bool, reclaimed: bool) -> JobRow {
        JobRow {
            job_id: id.into(),
            user_id: "u".into(),
            cost: 40,
            state: state.into(),
            attempts: 1,
            refunded,
            reclaimed,
            last_error: None,
        }
    }

    fn row(id: i64, job: &str, t: &str, amount: i64) -> LedgerRow {
        LedgerRow {
            id,
            job_id: job.into(),
            entry_type: t.into(),
            amount,
        }
    }

    #[test]
    fn every_terminal_path_nets_right() {
        let jobs = [
            job("a", "delivered", false, false),
            job("b", "delivered", true, true),
            job("c", "dead", true, false),
            job("d", "queued", true, false),
        ];
        let ledger = [
            row(1, "a", "charge", -40),
            row(2, "b", "charge", -40),
            row(3, "b", "refund", 40),
            row(4, "b", "reclaim", -40),
            row(5, "c", "charge", -40),
            row(6, "c", "refund", 40),
            row(7, "d", "charge", -40),
            row(8, "d", "refund", 40),
        ];
        let report = check(&jobs, &ledger);
        assert!(report.ok, "{report}");
        assert_eq!(report.balance["u"], -80);
        assert_eq!(report.pending, 1);
        assert_eq!(report.ledger["refund"], Sums { rows: 3, sum: 120 });
    }

    #[test]
    fn each_violation_is_named() {
        let cases: [(&[JobRow], &[LedgerRow], &str); 6] = [
            (
                &[job("a", "delivered", true, false)],
                &[row(1, "a", "charge", -40), row(2, "a", "refund", 40)],
                "net",
            ),
            (&[job("a", "delivered", false, false)], &[], "one_charge"),
            (
                &[job("a", "delivered", false, false)],
                &[row(1, "a", "charge", -41)],
                "charge_amount",
            ),
            (
                &[job("a", "failed", false, false)],
                &[row(1, "a", "charge", -40)],
                "net",
            ),
            (
                &[job("a", "delivered", false, true)],
                &[row(1, "a", "charge", -40), row(2, "a", "reclaim", -40)],
                "reclaim_without_refund",
            ),
            (&[], &[row(1, "x", "charge", -40)], "unknown_job"),
        ];
        for (jobs, ledger, invariant) in cases {
            let report = check(jobs, ledger);
            assert!(!report.ok);
            assert!(
                report.violations.iter().any(|v| v.invariant == invariant),
                "{invariant}: {report}"
            );
        }
    }
}
