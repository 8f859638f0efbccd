//! Captures the `tracing` spans code opens (on the current thread, or in the whole
//! process), with their fields as finally recorded and their parent, so a test can
//! assert what a trace shows.
//!
//! One subscriber is installed as the process's global default on first use, and
//! answers "sometimes" for every callsite: whether a span is recorded is decided each
//! time, by whether its thread (or the whole process) is capturing. A thread-scoped
//! default would not do: tracing caches a callsite's interest from the first thread
//! that reaches it, so a span first opened on a thread without a subscriber would be
//! lost to the capturing one.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};

/// One span: its name, its parent, and its fields.
#[derive(Clone, Debug)]
pub struct CapturedSpan {
    /// The span's place among the spans returned with it.
    pub index: usize,
    /// The span's name.
    pub name: &'static str,
    /// The parent span's place among the spans returned with it, if it had one.
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

/// A span as stored: which capture it belongs to, its parent's id.
struct Stored {
    session: u64,
    name: &'static str,
    parent: Option<usize>,
    fields: BTreeMap<&'static str, String>,
}

#[derive(Default)]
struct State {
    spans: Vec<Stored>,
    /// Per thread, the spans entered and not yet exited, innermost last.
    entered: HashMap<ThreadId, Vec<Id>>,
}

impl State {
    fn stack(&mut self) -> &mut Vec<Id> {
        self.entered.entry(std::thread::current().id()).or_default()
    }

    /// The spans of one capture, their indexes and parents renumbered among them.
    fn session(&self, session: u64) -> Vec<CapturedSpan> {
        let mut place = HashMap::new();
        let mut out: Vec<CapturedSpan> = Vec::new();
        for (i, s) in self.spans.iter().enumerate() {
            if s.session != session {
                continue;
            }
            place.insert(i, out.len());
            let parent_index = s.parent.and_then(|p| place.get(&p).copied());
            out.push(CapturedSpan {
                index: out.len(),
                name: s.name,
                parent_index,
                parent: parent_index.map(|p| out[p].name),
                fields: s.fields.clone(),
            });
        }
        out
    }
}

thread_local! {
    /// The capture this thread records into (0: none).
    static SESSION: Cell<u64> = const { Cell::new(0) };
}

/// The capture every thread records into when it has none of its own (0: none).
static PROCESS_SESSION: AtomicU64 = AtomicU64::new(0);
static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

fn current_session() -> u64 {
    match SESSION.with(Cell::get) {
        0 => PROCESS_SESSION.load(Ordering::Relaxed),
        s => s,
    }
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<State>>);

fn index(id: &Id) -> usize {
    usize::try_from(id.into_u64() - 1).unwrap_or(usize::MAX)
}

impl Subscriber for Capture {
    fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
        Interest::sometimes()
    }

    fn enabled(&self, _: &Metadata<'_>) -> bool {
        current_session() != 0
    }

    fn new_span(&self, attrs: &Attributes<'_>) -> Id {
        let mut state = self.0.lock().expect("spans");
        let parent = if attrs.is_contextual() {
            state.stack().last().cloned()
        } else {
            attrs.parent().cloned()
        };
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        state.spans.push(Stored {
            session: current_session(),
            name: attrs.metadata().name(),
            parent: parent.map(|p| index(&p)),
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

/// The process's capturing subscriber, installed on first use.
fn installed() -> &'static Capture {
    static GLOBAL: OnceLock<Capture> = OnceLock::new();
    GLOBAL.get_or_init(|| {
        let capture = Capture::default();
        tracing::subscriber::set_global_default(capture.clone())
            .expect("no other global subscriber in a test binary using spans");
        capture
    })
}

/// Runs `f`, capturing the spans this thread opens meanwhile (every level); returns
/// its result and those spans, in the order they were opened.
pub fn capture<T>(f: impl FnOnce() -> T) -> (T, Vec<CapturedSpan>) {
    let capture = installed();
    let session = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
    let before = SESSION.with(|s| s.replace(session));
    let out = f();
    SESSION.with(|s| s.set(before));
    let spans = capture.0.lock().expect("spans").session(session);
    (out, spans)
}

/// From now on, captures the spans every thread of the process opens (threads inside
/// a [`capture`] keep theirs); returns a reader of them. For code that runs on other
/// threads, like a consumer's tasks: other tests of the same binary are captured too,
/// so filter by what is yours.
pub fn capture_globally() -> impl Fn() -> Vec<CapturedSpan> {
    let capture = installed();
    let session = match PROCESS_SESSION.load(Ordering::Relaxed) {
        0 => {
            let fresh = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
            match PROCESS_SESSION.compare_exchange(0, fresh, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => fresh,
                Err(existing) => existing,
            }
        }
        existing => existing,
    };
    let shared = Arc::clone(&capture.0);
    move || shared.lock().expect("spans").session(session)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open() {
        let _span = tracing::debug_span!("probe").entered();
    }

    /// tracing caches a callsite's interest from the first thread that reaches it: a
    /// thread without a capture must not make the capturing one miss the span.
    #[test]
    fn a_span_first_opened_on_another_thread_is_still_captured() {
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            wait.recv().expect("go");
            open();
            done.send(()).expect("done");
        });
        let ((), spans) = capture(|| {
            go.send(()).expect("go");
            finished.recv().expect("finished");
            open();
        });
        other.join().expect("thread");
        assert_eq!(spans.len(), 1, "{spans:?}");
        assert_eq!(spans[0].name, "probe");
    }
}
