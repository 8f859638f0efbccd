//! Captures the `tracing` spans code opens (on the current thread, or in the whole
//! process), with their fields as finally recorded and their parent, so a test can
//! assert what a trace shows.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// One span: its name, its parent, and its fields.
#[derive(Clone, Debug)]
pub struct CapturedSpan {
    /// The span's place among the captured spans.
    pub index: usize,
    /// The span's name.
    pub name: &'static str,
    /// The parent span's place among the captured spans, if it had one.
    pub parent_index: Option<usize>,
    /// The parent span's name, if it had one.
    pub parent: Option<&'static str>,
    /// Fields by name, as `Debug` text (strings unquoted).
    pub fields: BTreeMap<&'static str, String>,
}

struct Fields<'a>(&'a mut BTreeMap<&'static str, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name(), value.to_owned());
    }
}

#[derive(Default)]
struct State {
    spans: Vec<CapturedSpan>,
    /// Per thread, the spans entered and not yet exited, innermost last.
    entered: HashMap<ThreadId, Vec<Id>>,
}

impl State {
    fn stack(&mut self) -> &mut Vec<Id> {
        self.entered.entry(std::thread::current().id()).or_default()
    }
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<State>>);

fn index(id: &Id) -> usize {
    usize::try_from(id.into_u64() - 1).unwrap_or(usize::MAX)
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, attrs: &Attributes<'_>) -> Id {
        let mut state = self.0.lock().expect("spans");
        let parent = if attrs.is_contextual() {
            state.stack().last().cloned()
        } else {
            attrs.parent().cloned()
        };
        let parent_index = parent.map(|p| index(&p));
        let parent = parent_index.and_then(|p| state.spans.get(p).map(|s| s.name));
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let index = state.spans.len();
        state.spans.push(CapturedSpan {
            index,
            name: attrs.metadata().name(),
            parent_index,
            parent,
            fields,
        });
        Id::from_u64(state.spans.len() as u64)
    }

    fn record(&self, id: &Id, values: &Record<'_>) {
        let mut state = self.0.lock().expect("spans");
        if let Some(span) = state.spans.get_mut(index(id)) {
            values.record(&mut Fields(&mut span.fields));
        }
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, _: &Event<'_>) {}

    fn enter(&self, id: &Id) {
        self.0.lock().expect("spans").stack().push(id.clone());
    }

    fn exit(&self, id: &Id) {
        let mut state = self.0.lock().expect("spans");
        let stack = state.stack();
        if let Some(at) = stack.iter().rposition(|e| e == id) {
            stack.remove(at);
        }
    }
}

/// Runs `f` with a subscriber of its own on this thread (every level enabled);
/// returns its result and the spans it opened, in the order they were opened.
pub fn capture<T>(f: impl FnOnce() -> T) -> (T, Vec<CapturedSpan>) {
    let capture = Capture::default();
    let out = tracing::subscriber::with_default(capture.clone(), f);
    let spans = std::mem::take(&mut capture.0.lock().expect("spans").spans);
    (out, spans)
}

/// Installs a capturing subscriber as the process's global default (for code that
/// runs on other threads, like a consumer's tasks) and returns a reader of what it
/// captured. A process gets one: call it from a test binary with a single test.
pub fn capture_globally() -> impl Fn() -> Vec<CapturedSpan> {
    static GLOBAL: OnceLock<Capture> = OnceLock::new();
    let capture = GLOBAL.get_or_init(|| {
        let capture = Capture::default();
        tracing::subscriber::set_global_default(capture.clone())
            .expect("no other global subscriber");
        capture
    });
    let shared = Arc::clone(&capture.0);
    move || shared.lock().expect("spans").spans.clone()
}
