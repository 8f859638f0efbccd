//! The usage consumer's rebuild schedule, as clap arguments ([`ScheduleArgs`]).
//! `usage_ops` mounts inbox-cli's projection commands (`audit daily_usage --window N`,
//! `rebuild daily_usage --window N`).

use std::time::Duration;

use clap::Args;

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
