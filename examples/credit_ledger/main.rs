//! `cargo run --example credit_ledger -- <command>`: the credit ledger of
//! refund-then-reclaim on PostgreSQL + RabbitMQ, or SQLite + the in-process transport.
//!
//! - `consume [--runner]`: the ledger consumer of `job.failed` / `job.succeeded`
//!   (group `credit.ledger`) and a relay of the outbox; `--runner` also runs the
//!   simulated job runner (group `credit.runner`, `job.run`). Until SIGTERM or ctrl-c.
//! - `submit --user U --cost C [--count N]`: submits jobs, prints one job id per line.
//! - `simulate N`: submits N jobs and runs everything until they settle, then prints
//!   the summary and checks the invariants.
//! - `check [--json]`: the invariants over the current tables.
//!
//! Environment: `DATABASE_URL` (`postgres://...` or an SQLite path; `simulate` without
//! it uses SQLite in a temporary directory), `AMQP_URL`, `INBOX_PREFIX`,
//! `CREDIT_SCHEMA` (PostgreSQL schema of every table, default `credit`), `RUST_LOG`,
//! `INBOX_LOG_FORMAT` (`json` for JSON lines), `INBOX_METRICS_ADDR` (`consume`: serve
//! `/metrics` in the Prometheus text format on this `host:port`).
//!
//! Exit codes: 0 done (and every invariant holds), 1 an invariant is violated (`check`,
//! `simulate`), 2 bad usage or an error (nothing reached, a startup failure).

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use diesel::{PgConnection, SqliteConnection};
use inbox_amqp::{cancel_on_signals, CancellationToken};
use inbox_core::RetryPolicy;
use inbox_diesel::{Backend, Store, StoreConnection};
use inbox_examples::credit::run::{self, BoxError, Config, Roles, DEFAULT_SCHEMA};
use inbox_examples::credit::{CreditDb, Mix, Report};

#[derive(Parser)]
#[command(
    name = "credit_ledger",
    about = "The credit ledger of refund-then-reclaim"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Consume job.failed / job.succeeded into the ledger (and relay the outbox).
    Consume {
        /// Also run the simulated job runner (consumes job.run).
        #[arg(long)]
        runner: bool,
        #[command(flatten)]
        jobs: JobArgs,
    },
    /// Submit jobs: charge each and enqueue its first run; prints one job id per line.
    Submit {
        /// The user charged (1 to 255 bytes).
        #[arg(long, value_parser = parse_user)]
        user: String,
        /// The cost in credits, fixed at charge time (1 to 2^63 - 1).
        #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
        cost: i64,
        /// How many jobs.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        count: u32,
    },
    /// Submit N jobs, run everything until they settle, print the summary and check.
    Simulate {
        /// How many jobs.
        #[arg(value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        jobs: u32,
        /// Use the in-process transport even with AMQP_URL set.
        #[arg(long)]
        in_process: bool,
        /// Give up (exit 2) when the jobs have not settled after this many seconds.
        #[arg(long, default_value_t = 300)]
        timeout_secs: u64,
        /// Print the report as JSON (as `check --json` does).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        jobs_args: JobArgs,
    },
    /// Check the invariants over the current tables; exit 1 on any violation.
    Check {
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// The job retry policy and the simulated runner's outcomes.
#[derive(Args, Clone)]
struct JobArgs {
    /// Attempts per job before it is dead.
    #[arg(long, env = "CREDIT_MAX_ATTEMPTS", default_value_t = 4)]
    max_attempts: u32,
    /// The delay before the second attempt, in milliseconds (doubling per attempt).
    #[arg(long, env = "CREDIT_RETRY_INITIAL_MS", default_value_t = 200)]
    retry_initial_ms: u64,
    /// The longest delay between two attempts, in milliseconds.
    #[arg(long, env = "CREDIT_RETRY_MAX_MS", default_value_t = 5_000)]
    retry_max_ms: u64,
    /// The runner's shares of outcomes in percent (the rest succeed).
    #[arg(long, env = "CREDIT_RUNNER_MIX", default_value_t = Mix::default())]
    mix: Mix,
}

impl JobArgs {
    fn policy(&self) -> Result<RetryPolicy, BoxError> {
        Ok(RetryPolicy::new(
            self.max_attempts,
            Duration::from_millis(self.retry_initial_ms),
            Duration::from_millis(self.retry_max_ms),
        )?)
    }
}

fn parse_user(text: &str) -> Result<String, String> {
    if text.is_empty() || text.len() > 255 || text.contains('\0') {
        return Err(format!(
            "a user id is 1 to 255 bytes without NUL, found {} bytes",
            text.len()
        ));
    }
    Ok(text.to_owned())
}

/// Picks the connection type from the URL's scheme.
macro_rules! on_backend {
    ($url:expr, $f:ident ( $($arg:expr),* )) => {
        match Backend::from_url($url)? {
            Backend::Postgres => $f::<PgConnection>($($arg),*),
            _ => $f::<SqliteConnection>($($arg),*),
        }
    };
}

fn main() -> ExitCode {
    let _logging = inbox_examples::init_logging();
    inbox_diesel::init_tls();
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("credit_ledger: {err}");
            let mut source = err.source();
            while let Some(cause) = source {
                eprintln!("  caused by: {cause}");
                source = cause.source();
            }
            ExitCode::from(2)
        }
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn config(database_url: String, jobs: Option<&JobArgs>) -> Result<Config, BoxError> {
    let default = JobArgs {
        max_attempts: 4,
        retry_initial_ms: 200,
        retry_max_ms: 5_000,
        mix: Mix::default(),
    };
    let jobs = jobs.unwrap_or(&default);
    Ok(Config {
        database_url,
        schema: env("CREDIT_SCHEMA").unwrap_or_else(|| DEFAULT_SCHEMA.to_owned()),
        prefix: env("INBOX_PREFIX").unwrap_or_default(),
        job_policy: jobs.policy()?,
        mix: jobs.mix,
    })
}

fn database_url() -> Result<String, BoxError> {
    env("DATABASE_URL").ok_or_else(|| {
        "DATABASE_URL must name the database (postgres://... or an SQLite path)".into()
    })
}

fn amqp_url() -> String {
    env("AMQP_URL").unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn runtime() -> Result<tokio::runtime::Runtime, BoxError> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn run(command: Command) -> Result<ExitCode, BoxError> {
    match command {
        Command::Consume { runner, jobs } => {
            let config = config(database_url()?, Some(&jobs))?;
            let url = config.database_url.clone();
            on_backend!(&url, consume(config, runner))
        }
        Command::Submit { user, cost, count } => {
            let config = config(database_url()?, None)?;
            let url = config.database_url.clone();
            on_backend!(&url, submit(&config, &user, cost, count))
        }
        Command::Check { json } => {
            let config = config(database_url()?, None)?;
            let url = config.database_url.clone();
            let report = on_backend!(&url, check(&config))?;
            Ok(print_report(&report, json))
        }
        Command::Simulate {
            jobs,
            in_process,
            timeout_secs,
            json,
            jobs_args,
        } => {
            let dir = tempfile::tempdir()?;
            let url = match env("DATABASE_URL") {
                Some(url) => url,
                None => dir.path().join("credit.db").to_string_lossy().into_owned(),
            };
            let config = config(url.clone(), Some(&jobs_args))?;
            let timeout = Duration::from_secs(timeout_secs);
            let amqp = env("AMQP_URL").filter(|_| !in_process);
            let on_broker = amqp.is_some() && Backend::from_url(&url)? == Backend::Postgres;
            let report = match amqp.filter(|_| on_broker) {
                Some(amqp) => {
                    let (report, s) = runtime()?.block_on(run::simulate_amqp::<PgConnection>(
                        config, amqp, jobs, timeout,
                    ))?;
                    if !json {
                        println!(
                            "simulate:       {jobs} jobs on PostgreSQL + RabbitMQ: {} deliveries, \
                             {} processed, {} duplicates, {} dead-lettered, {} published",
                            s.received, s.processed, s.duplicates, s.dead_lettered, s.published
                        );
                    }
                    report
                }
                None => {
                    let (report, s) =
                        on_backend!(&url, simulate_in_process(&config, jobs, timeout))?;
                    if !json {
                        println!(
                            "simulate:       {jobs} jobs on {:?} + the in-process transport: {} deliveries, \
                             {} duplicates, {} dead-lettered, {} job.dead",
                            Backend::from_url(&url)?,
                            s.delivered,
                            s.duplicates,
                            s.dead_lettered,
                            s.dead_jobs
                        );
                    }
                    report
                }
            };
            Ok(print_report(&report, json))
        }
    }
}

fn print_report(report: &Report, json: bool) -> ExitCode {
    if json {
        match serde_json::to_string_pretty(report) {
            Ok(text) => println!("{text}"),
            Err(err) => {
                eprintln!("credit_ledger: {err}");
                return ExitCode::from(2);
            }
        }
    } else {
        println!("{report}");
    }
    if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn simulate_in_process<C: StoreConnection + CreditDb>(
    config: &Config,
    jobs: u32,
    timeout: Duration,
) -> Result<(Report, run::InProcessStats), BoxError> {
    run::simulate_in_process::<C>(config, jobs, timeout)
}

fn open<C: StoreConnection + CreditDb>(config: &Config) -> Result<Store<C>, BoxError> {
    let roles = Roles {
        ledger: false,
        runner: false,
    };
    run::open_store::<C>(config, roles, None)
}

fn submit<C: StoreConnection + CreditDb>(
    config: &Config,
    user: &str,
    cost: i64,
    count: u32,
) -> Result<ExitCode, BoxError> {
    let store = open::<C>(config)?;
    for id in run::submit(&store, &config.exchange(), user, cost, count)? {
        println!("{id}");
    }
    Ok(ExitCode::SUCCESS)
}

fn check<C: StoreConnection + CreditDb>(config: &Config) -> Result<Report, BoxError> {
    run::check_store(&open::<C>(config)?)
}

fn consume<C: StoreConnection + CreditDb>(
    config: Config,
    runner: bool,
) -> Result<ExitCode, BoxError> {
    let amqp = amqp_url();
    let stats = runtime()?.block_on(async move {
        inbox_examples::scrape::serve_from_env("credit_ledger").await?;
        let shutdown = cancel_on_signals(CancellationToken::new());
        println!(
            "credit_ledger: consuming{}; stop with ctrl-c or SIGTERM",
            if runner { " with the runner" } else { "" }
        );
        run::consume::<C>(config, amqp, runner, shutdown).await
    })?;
    println!(
        "credit_ledger: stopped after {} deliveries: {} processed, {} duplicates, {} dead-lettered; {} published",
        stats.received, stats.processed, stats.duplicates, stats.dead_lettered, stats.published
    );
    Ok(ExitCode::SUCCESS)
}
