//! What the benchmark binaries share: their settings from the environment.

use std::fmt::Display;
use std::str::FromStr;

/// `DATABASE_URL` and `AMQP_URL`, or the local services the tests use.
pub fn service_urls() -> (String, String) {
    (
        std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into()),
        std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
    )
}

/// The setting `name` from the environment, or `default` when unset; a value that
/// does not parse stops the benchmark with a message saying so, rather than quietly
/// measuring something else.
pub fn env_or<T>(name: &str, default: T) -> T
where
    T: FromStr,
    T::Err: Display,
{
    match std::env::var(name) {
        Err(_) => default,
        Ok(value) => value
            .parse()
            .unwrap_or_else(|err| panic!("{name}={value:?} does not parse: {err}")),
    }
}

/// Free space, in KiB, on the file system holding `path` (`df -Pk`); `None` when
/// `df` is missing or says nothing readable.
pub fn free_disk_kib(path: &str) -> Option<u64> {
    let out = std::process::Command::new("df")
        .args(["-Pk", path])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()
}

/// Drops a benchmark's PostgreSQL schema when dropped itself, so a run that fails
/// half-way leaves nothing behind (signals: see [`drop_schema_on_signals`]).
pub struct SchemaGuard {
    url: String,
    schema: String,
}

impl SchemaGuard {
    /// Guards `schema` on the server at `url`.
    pub fn new(url: &str, schema: &str) -> Self {
        Self {
            url: url.to_owned(),
            schema: schema.to_owned(),
        }
    }
}

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        drop_schema(&self.url, &self.schema);
    }
}

fn drop_schema(url: &str, schema: &str) {
    use diesel::connection::SimpleConnection as _;
    use diesel::Connection as _;
    if let Ok(mut conn) = diesel::PgConnection::establish(url) {
        let _ = conn.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    }
}

/// On Ctrl-C or SIGTERM drops `schema` and exits with status 130 (a drop guard does
/// not run when a signal ends the process). Call inside a tokio runtime.
pub fn drop_schema_on_signals(url: &str, schema: &str) {
    let (url, schema) = (url.to_owned(), schema.to_owned());
    tokio::spawn(async move {
        inbox_amqp::shutdown_signal().await;
        eprintln!("interrupted: dropping schema {schema}");
        let _ = tokio::task::spawn_blocking(move || drop_schema(&url, &schema)).await;
        std::process::exit(130);
    });
}

/// `events` deliveries of a workload with duplicates, as the consume benchmarks send
/// them: `events * 10 / 11` distinct events, every tenth one sent again three events
/// later, the rest (if any) topped up from the start. The workload and the order of
/// its events' indexes.
pub fn workload_with_duplicates(events: usize, seed: u64) -> (crate::usage::Workload, Vec<usize>) {
    let unique = (events * 10 / 11).max(1);
    let workload = crate::usage::Workload::generate(unique, 0, seed);
    let mut order: Vec<usize> = Vec::with_capacity(events);
    for i in 0..unique {
        order.push(i);
        if i % 10 == 5 && order.len() < events {
            order.push(i.saturating_sub(3));
        }
    }
    while order.len() < events {
        order.push(order.len() % unique);
    }
    (workload, order)
}

/// Publishes the events of `workload` in `order` (duplicates included) to `exchange`
/// with `routing_key`, persistent, with publisher confirms; every one must be routed.
pub async fn publish_workload(
    conn: &lapin::Connection,
    exchange: &str,
    routing_key: &str,
    workload: &crate::usage::Workload,
    order: &[usize],
) -> Result<(), lapin::Error> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for &i in order {
        let (key, event) = &workload.events[i];
        let body = serde_json::to_vec(event).unwrap_or_default();
        channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                &body,
                lapin::BasicProperties::default()
                    .with_message_id(key.as_str().into())
                    .with_type(crate::usage::MESSAGE_TYPE.into())
                    .with_delivery_mode(2),
            )
            .await?;
    }
    let returned = channel.wait_for_confirms().await?;
    assert!(
        returned.is_empty(),
        "{} unroutable during fill",
        returned.len()
    );
    let _ = channel.close(200, "filled".into()).await;
    Ok(())
}

/// The median of `values` (0 when empty).
pub fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// The lowest and highest of `values` (0, 0 when empty).
pub fn range(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (low, high)
}

/// `url` (a `postgres://` URL) naming the database `database` instead of its own,
/// its query (`?sslmode=...`) kept.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let server = match base[authority_start..].find('/') {
        Some(slash) => &base[..authority_start + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{server}/{database}?{query}"),
        None => format!("{server}/{database}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_database_replaces_only_the_path() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1/test", "b1"),
            "postgres://postgres@127.0.0.1/b1"
        );
        assert_eq!(
            with_database("postgres://u:p@db:5433/app?sslmode=disable", "b1"),
            "postgres://u:p@db:5433/b1?sslmode=disable"
        );
        assert_eq!(with_database("postgres://db", "b1"), "postgres://db/b1");
    }

    #[test]
    fn the_workload_has_its_duplicates() {
        let (workload, order) = workload_with_duplicates(110, 1);
        assert_eq!((workload.events.len(), order.len()), (100, 110));
        let mut seen = std::collections::BTreeSet::new();
        assert_eq!(order.iter().filter(|i| !seen.insert(**i)).count(), 10);
    }
}
