//! The quickstart: 1,000 usage events through the in-process transport into the
//! projection, with duplicates, redeliveries and 3 poison events.

use std::fmt;

use diesel::{PgConnection, SqliteConnection};
use inbox_core::{Envelope, InProcessTransport, TransportStats};
use inbox_diesel::{Backend, Store, StoreConnection};

use crate::usage::{diff_totals, quick_policy, DailyUsage, Rng, UsageDb, Workload};

/// What a run did.
#[derive(Debug)]
pub struct Report {
    /// The backend.
    pub backend: Backend,
    /// Distinct events produced.
    pub events: usize,
    /// What the transport did.
    pub stats: TransportStats,
    /// Dead letters recorded.
    pub dead_letters: usize,
    /// Rows of the projection that differ from the expected totals.
    pub mismatches: Vec<String>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.stats;
        writeln!(f, "backend:        {:?}", self.backend)?;
        writeln!(f, "events:         {}", self.events)?;
        writeln!(f, "delivered:      {}", s.delivered)?;
        writeln!(f, "processed:      {}", s.processed)?;
        writeln!(f, "duplicates:     {}", s.duplicates)?;
        writeln!(f, "retries:        {}", s.retries)?;
        writeln!(
            f,
            "dead-lettered:  {} ({} dead-letter rows)",
            s.dead_lettered, self.dead_letters
        )?;
        if self.mismatches.is_empty() {
            write!(
                f,
                "totals:         every daily total equals the sum of its unique events"
            )
        } else {
            write!(
                f,
                "totals:         {} MISMATCHES: {:?}",
                self.mismatches.len(),
                self.mismatches
            )
        }
    }
}

/// Runs the quickstart against `url` (`postgres://...`, or an SQLite path); on
/// PostgreSQL the tables live in `schema`.
pub fn run(
    url: &str,
    schema: Option<&str>,
    events: usize,
) -> Result<Report, Box<dyn std::error::Error>> {
    match Backend::from_url(url)? {
        Backend::Postgres => run_on::<PgConnection>(url, schema, events),
        _ => run_on::<SqliteConnection>(url, None, events),
    }
}

fn run_on<C: StoreConnection + UsageDb>(
    url: &str,
    schema: Option<&str>,
    events: usize,
) -> Result<Report, Box<dyn std::error::Error>> {
    let mut builder = Store::<C>::builder(url).handler(DailyUsage::new(quick_policy()));
    if let Some(schema) = schema {
        builder = builder.schema(schema);
    }
    let store = builder.build()?;
    store.connection()?.create_daily_usage()?;

    let workload = Workload::generate(events, 3, 7);
    let mut transport = InProcessTransport::new(store.clone()).batch_size(50);
    let mut rng = Rng::new(11);
    for i in 0..workload.events.len() {
        transport.publish(workload.envelope(i))?;
        // The broker delivers some messages two or three times, some as redeliveries.
        let copies = match rng.below(10) {
            0 => 2,
            1 => 1,
            _ => 0,
        };
        for _ in 0..copies {
            let copy: Envelope = workload.envelope(i);
            transport.publish(if rng.below(2) == 0 {
                copy.redelivered()
            } else {
                copy
            })?;
        }
    }
    let stats = transport.run_until_idle()?;

    let found = store.connection()?.daily_totals()?;
    let group = inbox_core::ConsumerGroup::new(crate::usage::GROUP)?;
    Ok(Report {
        backend: store.backend(),
        events: workload.events.len(),
        stats,
        dead_letters: store.dead_letters(&group)?.len(),
        mismatches: diff_totals(&workload.expected_totals(), &found),
    })
}
