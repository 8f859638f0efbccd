//! Captures what code records through the `metrics` facade on the current thread, so
//! a test can assert the counters a call increments.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};

/// Counter totals and histogram samples, by name and sorted labels
/// (`name{label=value,...}`).
#[derive(Clone, Debug, Default)]
pub struct Captured {
    /// Counter totals.
    pub counters: BTreeMap<String, u64>,
    /// Histogram samples.
    pub histograms: BTreeMap<String, Vec<f64>>,
}

impl Captured {
    /// A counter's total (0 when never incremented); `labels` as (name, value) pairs.
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.counters
            .get(&render(name, labels.iter().copied()))
            .copied()
            .unwrap_or(0)
    }

    /// How many samples a histogram took.
    pub fn samples(&self, name: &str, labels: &[(&str, &str)]) -> usize {
        self.histograms
            .get(&render(name, labels.iter().copied()))
            .map_or(0, Vec::len)
    }
}

fn render<'a>(name: &str, labels: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    let mut labels: Vec<String> = labels.map(|(k, v)| format!("{k}={v}")).collect();
    labels.sort();
    format!("{name}{{{}}}", labels.join(","))
}

type Shared = Arc<Mutex<Captured>>;

struct Handle {
    key: String,
    captured: Shared,
}

impl CounterFn for Handle {
    fn increment(&self, value: u64) {
        let mut c = self.captured.lock().expect("captured");
        *c.counters.entry(self.key.clone()).or_default() += value;
    }

    fn absolute(&self, value: u64) {
        let mut c = self.captured.lock().expect("captured");
        c.counters.insert(self.key.clone(), value);
    }
}

impl HistogramFn for Handle {
    fn record(&self, value: f64) {
        let mut c = self.captured.lock().expect("captured");
        c.histograms
            .entry(self.key.clone())
            .or_default()
            .push(value);
    }
}

struct Capture(Shared);

impl Capture {
    fn handle(&self, key: &Key) -> Arc<Handle> {
        Arc::new(Handle {
            key: render(key.name(), key.labels().map(|l| (l.key(), l.value()))),
            captured: Arc::clone(&self.0),
        })
    }
}

impl Recorder for Capture {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.handle(key))
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.handle(key))
    }
}

/// Runs `f` with a recorder of its own on this thread; returns its result and what
/// it recorded. Code `f` runs on other threads records nowhere.
pub fn capture<T>(f: impl FnOnce() -> T) -> (T, Captured) {
    let shared: Shared = Arc::default();
    let recorder = Capture(Arc::clone(&shared));
    let out = metrics::with_local_recorder(&recorder, f);
    let captured = shared.lock().expect("captured").clone();
    (out, captured)
}

/// `GET /metrics` from `addr` (`host:port`) over plain HTTP/1.0: the body. Panics
/// unless the answer is 200 with the Prometheus text format's content type.
pub fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to /metrics");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("read timeout");
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    body.to_owned()
}
