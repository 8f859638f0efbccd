//! The simulated job runner's outcomes: for a configurable share of attempts it fails
//! transiently, fails permanently, "times out" and then finishes anyway, or times out
//! and then reports an error too; the rest succeed. The outcome of an attempt is a
//! pure function of (seed, job id, attempt), so a redelivered `job.run` decides the
//! same, and a run can be replayed.

use std::fmt;
use std::str::FromStr;

/// What one attempt does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// `job.succeeded`.
    Succeed,
    /// `job.failed` `{"reason": "dependency_unavailable", "transient": true}`.
    Transient,
    /// `job.failed` `{"reason": "invalid_input", "transient": false}`.
    Permanent,
    /// `job.failed` `{"reason": "timeout", "transient": true}`, then `job.succeeded`:
    /// the worker gave up at its deadline, the job finished two seconds later.
    TimeoutThenSucceed,
    /// `job.failed` `timeout`, then a second `job.failed` `error_callback` (distinct
    /// message ids) for the same attempt.
    TimeoutThenError,
}

/// Shares of attempts per outcome, in percent; the rest succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mix {
    /// [`Outcome::Transient`].
    pub transient: u8,
    /// [`Outcome::Permanent`].
    pub permanent: u8,
    /// [`Outcome::TimeoutThenSucceed`].
    pub timeout: u8,
    /// [`Outcome::TimeoutThenError`].
    pub double: u8,
    /// Varies the outcomes between runs.
    pub seed: u64,
}

impl Default for Mix {
    /// `transient=25,permanent=5,timeout=20,double=10,seed=1`.
    fn default() -> Self {
        Self {
            transient: 25,
            permanent: 5,
            timeout: 20,
            double: 10,
            seed: 1,
        }
    }
}

impl fmt::Display for Mix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "transient={},permanent={},timeout={},double={},seed={}",
            self.transient, self.permanent, self.timeout, self.double, self.seed
        )
    }
}

impl FromStr for Mix {
    type Err = String;

    /// `transient=25,permanent=5,timeout=20,double=10,seed=1`; missing shares are 0
    /// (the seed 1), the shares add up to at most 100.
    fn from_str(text: &str) -> Result<Self, String> {
        let mut mix = Mix {
            transient: 0,
            permanent: 0,
            timeout: 0,
            double: 0,
            seed: 1,
        };
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| format!("expected name=value, found {part:?}"))?;
            if name == "seed" {
                mix.seed = value
                    .parse()
                    .map_err(|_| format!("seed must be a number, found {value:?}"))?;
                continue;
            }
            let pct: u8 =
                value.parse().ok().filter(|p| *p <= 100).ok_or_else(|| {
                    format!("{name} must be a percentage 0 to 100, found {value:?}")
                })?;
            match name {
                "transient" => mix.transient = pct,
                "permanent" => mix.permanent = pct,
                "timeout" => mix.timeout = pct,
                "double" => mix.double = pct,
                other => {
                    return Err(format!(
                        "unknown share {other:?}; expected transient, permanent, timeout, double or seed"
                    ))
                }
            }
        }
        let total = u32::from(mix.transient)
            + u32::from(mix.permanent)
            + u32::from(mix.timeout)
            + u32::from(mix.double);
        if total > 100 {
            return Err(format!("the shares add up to {total}%, more than 100%"));
        }
        Ok(mix)
    }
}

impl Mix {
    /// The outcome of `attempt` of `job_id`.
    pub fn outcome(&self, job_id: &str, attempt: i32) -> Outcome {
        let roll = (fnv1a(self.seed, job_id, attempt) % 100) as u8;
        let mut edge = self.transient;
        if roll < edge {
            return Outcome::Transient;
        }
        edge += self.permanent;
        if roll < edge {
            return Outcome::Permanent;
        }
        edge += self.timeout;
        if roll < edge {
            return Outcome::TimeoutThenSucceed;
        }
        edge += self.double;
        if roll < edge {
            return Outcome::TimeoutThenError;
        }
        Outcome::Succeed
    }
}

/// FNV-1a over the seed, the id and the attempt.
fn fnv1a(seed: u64, job_id: &str, attempt: i32) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let bytes = seed
        .to_le_bytes()
        .into_iter()
        .chain(job_id.bytes())
        .chain(attempt.to_le_bytes());
    for b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    // FNV's low bits are weak for short inputs: fold the high half in.
    hash ^ (hash >> 29)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        let mix: Mix = "transient=10, timeout=5,seed=9"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (mix.transient, mix.permanent, mix.timeout, mix.seed),
            (10, 0, 5, 9)
        );
        assert_eq!(
            Mix::default().to_string().parse::<Mix>(),
            Ok(Mix::default())
        );
        for bad in [
            "transient",
            "transient=101",
            "other=1",
            "transient=60,timeout=50",
        ] {
            assert!(bad.parse::<Mix>().is_err(), "{bad}");
        }
    }

    #[test]
    fn outcomes_follow_the_shares() {
        let mix = Mix::default();
        let mut counts = [0u32; 5];
        for i in 0..10_000 {
            let o = mix.outcome(&format!("job-{i}"), 1);
            counts[o as usize] += 1;
            assert_eq!(o, mix.outcome(&format!("job-{i}"), 1));
        }
        // Roughly 40/25/5/20/10 percent.
        for (got, want) in counts.iter().zip([4000, 2500, 500, 2000, 1000]) {
            assert!(got.abs_diff(want) < 400, "{counts:?}");
        }
        let none = Mix {
            transient: 0,
            permanent: 0,
            timeout: 0,
            double: 0,
            seed: 1,
        };
        assert_eq!(none.outcome("j", 1), Outcome::Succeed);
    }
}
