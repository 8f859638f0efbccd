//! `selftest`: canaries through the user's own deployment.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_amqp::{CancellationToken, Relay, RelaySettings};
use inbox_diesel::operator::Operator;
use inbox_diesel::operator::{CanaryReport, OperatorConnection};
use inbox_diesel::Store;
use serde_json::json;

use crate::args::{GlobalArgs, SelftestArgs};
use crate::commands::duration_arg;
use crate::exit;
use crate::failure::{failed, Failure, Outcome};
use crate::output::{print, print_json};

fn ms(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64() * 1000.0)
}

pub(crate) fn run<C: OperatorConnection>(
    global: &GlobalArgs,
    store: &Store<C>,
    args: &SelftestArgs,
    out: &mut dyn Write,
) -> Outcome {
    let timeout = duration_arg(&args.timeout, "timeout")?;
    if args.count == 0 {
        return Err(Failure::new(exit::USAGE, "--count must be at least 1"));
    }
    let relay_url = match (args.relay, &args.amqp_url) {
        (true, None) => {
            return Err(Failure::new(
                exit::USAGE,
                "--relay needs AMQP_URL (or --amqp-url)",
            ))
        }
        (true, Some(url)) => Some(url.clone()),
        (false, _) => None,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(failed)?;
    if let Some(url) = &args.amqp_url {
        // A broker that refuses the connection or the login fails the command at
        // once (exit 1), before a canary is enqueued: it is not a lost canary.
        runtime.block_on(async {
            let conn = inbox_amqp::connect(url, args.ca_cert.as_deref())
                .await
                .map_err(|e| failed(format!("broker: {}", inbox_core::ErrorChain(&e))))?;
            let _ = conn.close(200, "selftest".into()).await;
            Ok::<_, Failure>(())
        })?;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let run = format!("st-{}-{nanos:x}", std::process::id());
    let exchange = format!("{}{}", global.prefix, args.exchange);
    Operator::new(store)
        .enqueue_canaries(&run, args.count, &exchange)
        .map_err(failed)?;

    let shutdown = CancellationToken::new();
    let relaying = relay_url.map(|url| {
        let mut settings = RelaySettings::default();
        settings.poll_interval = Duration::from_millis(50);
        settings.relay_id = format!("selftest-{run}");
        settings.connection.ca_cert = args.ca_cert.clone();
        let relay = Relay::new(url, Arc::new(store.clone())).with_settings(settings);
        runtime.spawn(relay.run(shutdown.clone()))
    });
    let started = Instant::now();
    let report = runtime.block_on(async {
        loop {
            let report = Operator::new(store).canary_report(&run, args.count)?;
            if report.arrived >= args.count || started.elapsed() >= timeout {
                // A short grace for a double still in flight once all arrived.
                return Ok::<CanaryReport, inbox_diesel::Error>(report);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    shutdown.cancel();
    if let Some(handle) = relaying {
        let _ = runtime.block_on(handle);
    }
    let report = report.map_err(failed)?;
    let ok = report.lost == 0 && report.doubled == 0;
    if global.json {
        print_json(
            out,
            &json!({
                "run": report.run,
                "sent": report.sent,
                "arrived": report.arrived,
                "lost": report.lost,
                "doubled": report.doubled,
                "latency_ms": {
                    "p50": ms(report.percentile(50)),
                    "p90": ms(report.percentile(90)),
                    "p99": ms(report.percentile(99)),
                    "max": ms(report.latencies.last().copied()),
                },
                "passed": ok,
            }),
        )?;
    } else {
        let lat =
            |p| ms(report.percentile(p)).map_or_else(|| "-".to_owned(), |v| format!("{v:.1}ms"));
        print(
            out,
            format!(
                "selftest {}: sent {}, arrived {}, lost {}, doubled {}; latency p50 {} p90 {} p99 {}\n",
                report.run,
                report.sent,
                report.arrived,
                report.lost,
                report.doubled,
                lat(50),
                lat(90),
                lat(99)
            ),
        )?;
    }
    if ok {
        Ok(())
    } else {
        Err(Failure::new(
            exit::SELFTEST_FAILED,
            format!(
                "selftest failed: {} of {} canaries lost, {} doubled within {:?} (is a consumer with the canary handler running, and a relay?)",
                report.lost, report.sent, report.doubled, timeout
            ),
        )
        .reported())
    }
}
