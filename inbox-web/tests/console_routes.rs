//! The console's routes on both backends: every page as HTML and JSON, every action
//! and its confirmation, every refusal (no token, wrong token, missing or foreign CSRF
//! token, another origin, read-only mode, a letter already replayed or discarded, a
//! group not halted), hostile payloads, bounded bulk actions and the audit log.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::Router;
use chrono::{TimeZone, Utc};
use inbox_core::{
    ClaimInvariantViolated, Envelope, GroupHalts, ManualClock, MessageKey, RetryPolicy,
};
use inbox_diesel::operator::{DeadLetterFilter, LetterStatus, Operator};
use inbox_diesel::Store;
use inbox_test_support::{group, on_both_backends, Fixture, FullConnection, Outcome, Recorder};
use inbox_web::Console;
use serde_json::Value;
use tower::ServiceExt;

const GROUP: &str = "billing.daily-usage";
const OTHER: &str = "billing.audit";

fn store<F: Fixture>(fx: &F) -> Store<F::Conn>
where
    F::Conn: FullConnection,
{
    store_with_clock(
        fx,
        Arc::new(ManualClock::new(
            Utc.with_ymd_and_hms(2026, 3, 1, 12, 0, 0).unwrap(),
        )),
    )
}

fn store_with_clock<F: Fixture>(fx: &F, clock: Arc<ManualClock>) -> Store<F::Conn>
where
    F::Conn: FullConnection,
{
    let failing = Recorder::new(GROUP)
        .policy(RetryPolicy::new(1, Duration::from_secs(1), Duration::from_secs(1)).unwrap())
        .behaviour(|key, _| {
            if key.contains("ok") {
                Outcome::Apply
            } else if let Some(word) = key.strip_prefix("word-") {
                Outcome::FailWith(format!("unknown customer {word}"))
            } else {
                Outcome::FailWith(format!(
                    "\"><img src=x onerror=alert(1)> ledger row {} is locked <script>alert('e')</script>",
                    key.len()
                ))
            }
        });
    let store = fx
        .builder()
        .clock(clock)
        .handler(failing)
        .build()
        .expect("store");
    use inbox_test_support::TestConn;
    store.connection().unwrap().create_effects().unwrap();
    store
}

/// Dead-letters one message (the handler fails it on its only attempt).
fn dead_letter<C: FullConnection>(
    store: &Store<C>,
    key: &str,
    payload: Vec<u8>,
    headers: &[(&str, &str)],
) -> i64 {
    let mut env = Envelope::new(MessageKey::new(key).unwrap(), "usage.recorded", payload);
    env.headers = headers
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect::<BTreeMap<_, _>>();
    store.process_batch(&group(GROUP), &[env]).unwrap();
    let letters = Operator::new(store)
        .list_dead_letters(
            &inbox_diesel::operator::DeadLetterFilter::default().message_key(key),
            0,
            1,
        )
        .unwrap();
    letters[0].id
}

fn usage_body() -> Vec<u8> {
    br#"{"amount":5}"#.to_vec()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A browser's view of the console: its cookie and the last CSRF token it saw.
struct Browser {
    app: Router,
    rt: tokio::runtime::Runtime,
    cookie: Option<String>,
    csrf: Option<String>,
    origin: String,
}

struct Answer {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

impl Browser {
    fn new(app: Router) -> Self {
        Self {
            app,
            rt: rt(),
            cookie: None,
            csrf: None,
            origin: "http://127.0.0.1:8080".into(),
        }
    }

    fn send(&mut self, req: Request<Body>) -> Answer {
        let response = self.rt.block_on(self.app.clone().oneshot(req)).unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        if let Some(c) = headers.get(header::SET_COOKIE) {
            let c = c.to_str().unwrap();
            let pair = c.split(';').next().unwrap().to_owned();
            self.cookie = if pair.ends_with('=') {
                None
            } else {
                Some(pair)
            };
        }
        let bytes = self
            .rt
            .block_on(axum::body::to_bytes(response.into_body(), 64 * 1024 * 1024))
            .unwrap();
        let body = String::from_utf8_lossy(&bytes).into_owned();
        if let Some(at) = body.find("name=\"csrf\" value=\"") {
            let rest = &body[at + 19..];
            self.csrf = Some(rest[..rest.find('"').unwrap()].to_owned());
        }
        Answer {
            status,
            headers,
            body,
        }
    }

    fn request(&self, method: &str, path: &str) -> axum::http::request::Builder {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "127.0.0.1:8080");
        if let Some(c) = &self.cookie {
            b = b.header(header::COOKIE, c);
        }
        b
    }

    fn get(&mut self, path: &str) -> Answer {
        let req = self
            .request("GET", path)
            .header(header::ACCEPT, "text/html")
            .body(Body::empty())
            .unwrap();
        self.send(req)
    }

    fn get_json(&mut self, path: &str) -> Answer {
        let req = self
            .request("GET", path)
            .header(header::ACCEPT, "application/json")
            .body(Body::empty())
            .unwrap();
        self.send(req)
    }

    /// A form POST from the console's own origin with the session's CSRF token.
    fn post(&mut self, path: &str, fields: &[(&str, &str)]) -> Answer {
        let mut all: Vec<(&str, &str)> = fields.to_vec();
        let csrf = self.csrf.clone().unwrap_or_default();
        all.push(("csrf", &csrf));
        self.post_raw(path, &all, Some(&self.origin.clone()), "text/html")
    }

    fn post_raw(
        &mut self,
        path: &str,
        fields: &[(&str, &str)],
        origin: Option<&str>,
        accept: &str,
    ) -> Answer {
        let mut b = self
            .request("POST", path)
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(header::ACCEPT, accept);
        if let Some(o) = origin {
            b = b.header(header::ORIGIN, o);
        }
        let req = b
            .body(Body::from(serde_urlencoded::to_string(fields).unwrap()))
            .unwrap();
        self.send(req)
    }
}

fn status_of<C: FullConnection>(store: &Store<C>, id: i64) -> LetterStatus {
    Operator::new(store)
        .dead_letter_details(id)
        .unwrap()
        .unwrap()
        .entry
        .status
}

/// Every page answers as HTML and as JSON, with the CLI's field names, and carries the
/// security headers.
fn every_page_renders_as_html_and_json<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let id = dead_letter(
        &store,
        "k-1",
        br#"{"amount":5}"#.to_vec(),
        &[("tenant", "acme")],
    );
    let fp = Operator::new(&store)
        .dead_letter_details(id)
        .unwrap()
        .unwrap()
        .entry
        .failure_group;
    let mut b = Browser::new(Console::new(Operator::new(&store)).router());
    let pages = [
        ("/".to_owned(), "groups"),
        ("/failures".to_owned(), "failure_groups"),
        (format!("/letters?failure_group={fp}"), "dead_letters"),
        (format!("/letters/{id}"), "payload"),
        ("/halts".to_owned(), "halted"),
        ("/outbox".to_owned(), "dead_outbox_rows"),
        ("/claims?key=k-1".to_owned(), "claims"),
        ("/rebuilds".to_owned(), "rebuild_reports"),
    ];
    for (path, field) in &pages {
        let html = b.get(path);
        assert_eq!(html.status, StatusCode::OK, "{path}: {}", html.body);
        assert!(html.body.starts_with("<!DOCTYPE html>"), "{path}");
        assert_eq!(
            html.headers[header::CONTENT_SECURITY_POLICY],
            inbox_web::CONTENT_SECURITY_POLICY,
            "{path}"
        );
        assert_eq!(html.headers[header::X_FRAME_OPTIONS], "DENY");
        let json = b.get_json(path);
        assert_eq!(json.status, StatusCode::OK, "{path}");
        assert!(json.headers[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("application/json"));
        assert!(
            json.json().get(*field).is_some(),
            "{path}: no {field} in {}",
            json.body
        );
    }
    let letter = b.get_json(&format!("/letters/{id}")).json();
    assert_eq!(letter["message_key"], "k-1");
    assert_eq!(letter["payload"], r#"{"amount":5}"#);
    assert_eq!(letter["headers"]["tenant"], "acme");
    assert_eq!(letter["status"], "pending");
    assert_eq!(letter["history"][0]["id"], id);
    let groups = b.get_json("/failures").json();
    assert_eq!(groups["failure_groups"][0]["fingerprint"], fp.as_str());
    assert_eq!(groups["failure_groups"][0]["count"], 1);
    // Bad input gets a clear 400.
    for (path, says) in [
        ("/letters/abc", "is a number"),
        ("/letters?since=yesterday", "RFC 3339"),
        ("/letters?status=gone", "status"),
        ("/letters?limit=100000", "limit"),
        ("/letters?failure_group=%3Cx%3E", "16 lower-case hex"),
        ("/letters?reason=nope", "reason"),
    ] {
        let a = b.get_json(path);
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{path}");
        assert!(
            a.json()["error"].as_str().unwrap().contains(says),
            "{path}: {}",
            a.body
        );
    }
    assert_eq!(b.get("/letters/999999").status, StatusCode::NOT_FOUND);
    assert_eq!(b.get("/nowhere").status, StatusCode::NOT_FOUND);
}

/// A replay asks first, then replays once; a second replay, a discard after it and a
/// replay of a discarded letter are refused with what the operator API decided.
fn a_letter_is_confirmed_replayed_once_and_refused_after<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let id = dead_letter(&store, "k-2", usage_body(), &[]);
    let other = dead_letter(&store, "k-3", usage_body(), &[]);
    let mut b = Browser::new(Console::new(Operator::new(&store)).router());
    b.get(&format!("/letters/{id}"));
    let ask = b.post(&format!("/letters/{id}/replay"), &[]);
    assert_eq!(ask.status, StatusCode::OK);
    assert!(ask.body.contains("Replay dead letter"), "{}", ask.body);
    assert_eq!(
        status_of(&store, id),
        LetterStatus::Pending,
        "asking changes nothing"
    );
    let done = b.post(&format!("/letters/{id}/replay"), &[("confirm", "yes")]);
    assert_eq!(done.status, StatusCode::OK, "{}", done.body);
    assert!(done.body.contains("replayed"), "{}", done.body);
    assert_eq!(status_of(&store, id), LetterStatus::Replayed);
    let again = b.post_raw(
        &format!("/letters/{id}/replay"),
        &[("confirm", "yes"), ("csrf", &b.csrf.clone().unwrap())],
        Some("http://127.0.0.1:8080"),
        "application/json",
    );
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(again.json()["outcome"], "claim_not_dead");
    // Discard, then a replay of the discarded letter and a second discard.
    assert_eq!(
        b.post(&format!("/letters/{other}/discard"), &[("confirm", "yes")])
            .status,
        StatusCode::OK
    );
    assert_eq!(status_of(&store, other), LetterStatus::Discarded);
    let r = b.post(&format!("/letters/{other}/replay"), &[("confirm", "yes")]);
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert!(r.body.contains("discarded"), "{}", r.body);
    let d = b.post(&format!("/letters/{other}/discard"), &[("confirm", "yes")]);
    assert_eq!(d.status, StatusCode::CONFLICT);
    assert!(d.body.contains("discarded already"), "{}", d.body);
    assert_eq!(
        b.post("/letters/424242/replay", &[("confirm", "yes")])
            .status,
        StatusCode::NOT_FOUND
    );
}

/// Without the session's CSRF token, with another session's, or from another origin,
/// an action is refused and nothing changes.
fn actions_need_the_sessions_csrf_token_and_the_consoles_origin<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let id = dead_letter(&store, "k-4", usage_body(), &[]);
    let app = Console::new(Operator::new(&store))
        .session_key(b"shared".to_vec())
        .router();
    let mut b = Browser::new(app.clone());
    b.get(&format!("/letters/{id}"));
    let path = format!("/letters/{id}/replay");
    let missing = b.post_raw(
        &path,
        &[("confirm", "yes")],
        Some("http://127.0.0.1:8080"),
        "text/html",
    );
    assert_eq!(missing.status, StatusCode::FORBIDDEN, "{}", missing.body);
    assert!(missing.body.contains("CSRF"));
    let mut other = Browser::new(app);
    other.get(&format!("/letters/{id}"));
    let foreign = other.csrf.clone().unwrap();
    assert_ne!(Some(&foreign), b.csrf.as_ref());
    let wrong = b.post_raw(
        &path,
        &[("confirm", "yes"), ("csrf", &foreign)],
        Some("http://127.0.0.1:8080"),
        "text/html",
    );
    assert_eq!(wrong.status, StatusCode::FORBIDDEN);
    let csrf = b.csrf.clone().unwrap();
    let cross = b.post_raw(
        &path,
        &[("confirm", "yes"), ("csrf", &csrf)],
        Some("http://evil.example"),
        "text/html",
    );
    assert_eq!(cross.status, StatusCode::FORBIDDEN);
    assert!(cross.body.contains("another origin"));
    // No cookie at all (a forged cross-site form without the session).
    b.cookie = None;
    let no_session = b.post_raw(
        &path,
        &[("confirm", "yes"), ("csrf", &csrf)],
        Some("http://127.0.0.1:8080"),
        "text/html",
    );
    assert_eq!(no_session.status, StatusCode::FORBIDDEN);
    assert_eq!(
        status_of(&store, id),
        LetterStatus::Pending,
        "nothing was replayed"
    );
}

/// Read-only mode shows no action and refuses every action.
fn read_only_refuses_every_action<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let id = dead_letter(&store, "k-5", usage_body(), &[]);
    let fp = Operator::new(&store)
        .dead_letter_details(id)
        .unwrap()
        .unwrap()
        .entry
        .failure_group;
    // A session and its CSRF token from a console with the same key that may act,
    // so the refusal below is read-only mode's, not the CSRF check's.
    let mut writer = Browser::new(
        Console::new(Operator::new(&store))
            .session_key(b"k".to_vec())
            .router(),
    );
    writer.get(&format!("/letters/{id}"));
    let mut b = Browser::new(
        Console::new(Operator::new(&store))
            .session_key(b"k".to_vec())
            .read_only(true)
            .router(),
    );
    b.cookie = writer.cookie.clone();
    b.csrf = writer.csrf.clone();
    let page = b.get(&format!("/letters/{id}"));
    assert!(
        !page.body.contains("/replay\""),
        "no replay form: {}",
        page.body
    );
    assert!(!page.body.contains("name=\"csrf\""), "no form at all");
    assert!(page.body.contains("read-only"));
    for path in [
        format!("/letters/{id}/replay"),
        format!("/letters/{id}/discard"),
        format!("/failures/{fp}/replay"),
        format!("/failures/{fp}/discard"),
        "/halts/resume".to_owned(),
        "/outbox/revive".to_owned(),
    ] {
        let a = b.post(&path, &[("confirm", "yes"), ("group", GROUP), ("id", "1")]);
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{path}");
        assert!(
            a.body.contains("the console is read-only"),
            "{path}: {}",
            a.body
        );
    }
    assert_eq!(status_of(&store, id), LetterStatus::Pending);
}

/// With a token: pages need a session (login form) or the bearer token; a wrong token
/// is refused; logging out ends the browser's session.
fn a_token_console_needs_the_token<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let id = dead_letter(&store, "k-6", usage_body(), &[]);
    let mut b = Browser::new(
        Console::new(Operator::new(&store))
            .token("t0ken-of-the-console")
            .router(),
    );
    let page = b.get("/");
    assert_eq!(page.status, StatusCode::SEE_OTHER, "to the login form");
    assert_eq!(page.headers[header::LOCATION], "/login");
    assert_eq!(b.get_json("/failures").status, StatusCode::UNAUTHORIZED);
    let path = format!("/letters/{id}/discard");
    let anonymous = b.post_raw(
        &path,
        &[("confirm", "yes")],
        Some("http://127.0.0.1:8080"),
        "text/html",
    );
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(b.get("/login").status, StatusCode::OK);
    let wrong = b.post_raw(
        "/login",
        &[("token", "t0ken-of-the-consol")],
        Some("http://127.0.0.1:8080"),
        "text/html",
    );
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(b.cookie.is_none(), "no session for a wrong token");
    let right = b.post_raw(
        "/login",
        &[("token", "t0ken-of-the-console")],
        Some("http://127.0.0.1:8080"),
        "text/html",
    );
    assert_eq!(right.status, StatusCode::SEE_OTHER);
    let cookie = right.headers[header::SET_COOKIE]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    assert_eq!(b.get("/").status, StatusCode::OK);
    // A login session is still bound to its CSRF token.
    let no_csrf = b.post_raw(
        &path,
        &[("confirm", "yes")],
        Some("http://127.0.0.1:8080"),
        "text/html",
    );
    assert_eq!(no_csrf.status, StatusCode::FORBIDDEN);
    assert_eq!(b.post(&path, &[("confirm", "yes")]).status, StatusCode::OK);
    assert_eq!(status_of(&store, id), LetterStatus::Discarded);
    // The bearer token, and a wrong one.
    let req = |token: &str| {
        Request::builder()
            .uri("/failures")
            .header(header::ACCEPT, "application/json")
            .header(header::AUTHORIZATION, format!("Bearer {token}"))
            .body(Body::empty())
            .unwrap()
    };
    let mut script = Browser::new(b.app.clone());
    assert_eq!(
        script.send(req("t0ken-of-the-console")).status,
        StatusCode::OK
    );
    assert_eq!(script.send(req("t0ken")).status, StatusCode::UNAUTHORIZED);
    // A visitor session of a mounted console signed with the same key is no login.
    let mut visitor = Browser::new(
        Console::new(Operator::new(&store))
            .session_key(b"same".to_vec())
            .router(),
    );
    visitor.get("/");
    let mut guarded = Browser::new(
        Console::new(Operator::new(&store))
            .session_key(b"same".to_vec())
            .token("t0ken-of-the-console")
            .router(),
    );
    guarded.cookie = visitor.cookie.clone();
    assert!(guarded.cookie.is_some());
    assert_eq!(
        guarded.get("/").status,
        StatusCode::SEE_OTHER,
        "a visitor cookie is not a login"
    );
    b.post("/logout", &[]);
    assert!(b.cookie.is_none());
    assert_eq!(b.get("/").status, StatusCode::SEE_OTHER);
}

/// A payload, key, header or error that carries markup is shown escaped; a body that is
/// not UTF-8 as hex; a huge body bounded.
fn hostile_letters_render_escaped_and_bounded<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let key = "<script>alert('key')</script>\"'><b>";
    let id = dead_letter(
        &store,
        key,
        b"<script>alert('payload')</script><img src=x onerror=alert(2)>".to_vec(),
        &[
            (
                "x-h\"><script>alert(3)</script>",
                "\"><svg onload=alert(4)>",
            ),
            ("tenant", "</td></tr></table><h1>"),
        ],
    );
    let binary = dead_letter(&store, "k-bin", vec![0xff, 0xfe, 0x00, b'<', b's'], &[]);
    let huge = dead_letter(&store, "k-huge", vec![b'<'; 2 * 1024 * 1024], &[]);
    let mut b = Browser::new(Console::new(Operator::new(&store)).router());
    let forbidden = ["<script", "<img", "<svg onload", "</table><h1>", "'><b>"];
    for path in [
        "/".to_owned(),
        "/failures".to_owned(),
        "/letters".to_owned(),
        format!("/letters/{id}"),
        format!("/claims?key={}", inbox_web_enc(key)),
    ] {
        let page = b.get(&path);
        assert_eq!(page.status, StatusCode::OK, "{path}");
        for bad in forbidden {
            assert!(!page.body.contains(bad), "{path}: raw {bad:?} in the page");
        }
    }
    let page = b.get(&format!("/letters/{id}"));
    assert!(
        page.body.contains("&lt;script&gt;alert('payload')"),
        "payload escaped"
    );
    assert!(
        page.body.contains("&lt;script&gt;alert(3)"),
        "header name escaped"
    );
    let page = b.get(&format!("/letters/{binary}"));
    assert!(page.body.contains("ff fe 00 3c 73"), "hex: {}", page.body);
    let page = b.get(&format!("/letters/{huge}"));
    assert_eq!(page.status, StatusCode::OK);
    assert!(
        page.body.len() < 400 * 1024,
        "a 2 MiB body makes a {} byte page",
        page.body.len()
    );
    assert!(page.body.contains("are shown"));
    // JSON keeps the values exactly.
    let json = b.get_json(&format!("/letters/{id}")).json();
    assert_eq!(json["message_key"], key);
    assert_eq!(
        json["payload"],
        "<script>alert('payload')</script><img src=x onerror=alert(2)>"
    );
}

fn inbox_web_enc(s: &str) -> String {
    serde_urlencoded::to_string([("", s)])
        .unwrap()
        .trim_start_matches('=')
        .to_owned()
}

/// A failure group's replay is bounded per click and says how many it touched.
fn a_bulk_action_is_bounded_and_counts<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    for i in 0..3 {
        dead_letter(&store, &format!("bulk-{i}"), usage_body(), &[]);
    }
    let letters = Operator::new(&store)
        .list_dead_letters(&Default::default(), 0, 10)
        .unwrap();
    let fp = letters[0].failure_group.clone();
    assert!(letters.iter().all(|l| l.failure_group == fp));
    let mut b = Browser::new(Console::new(Operator::new(&store)).max_bulk(2).router());
    b.get("/failures");
    let ask = b.post_raw(
        &format!("/failures/{fp}/replay"),
        &[("csrf", &b.csrf.clone().unwrap())],
        Some("http://127.0.0.1:8080"),
        "application/json",
    );
    assert_eq!(ask.json()["confirm"]["touches"], 2);
    let ask = b.post(&format!("/failures/{fp}/replay"), &[]);
    assert!(ask.body.contains("More than 2 match"), "{}", ask.body);
    let first = b.post_raw(
        &format!("/failures/{fp}/replay"),
        &[("confirm", "yes"), ("csrf", &b.csrf.clone().unwrap())],
        Some("http://127.0.0.1:8080"),
        "application/json",
    );
    let first = first.json();
    assert_eq!(
        (
            first["matched"].as_u64(),
            first["replayed"].as_u64(),
            first["limit"].as_u64()
        ),
        (Some(2), Some(2), Some(2))
    );
    let second = b.post(&format!("/failures/{fp}/replay"), &[("confirm", "yes")]);
    assert!(second.body.contains("Replayed 1 of 1"), "{}", second.body);
    let none = b.post(&format!("/failures/{fp}/discard"), &[("confirm", "yes")]);
    assert!(none.body.contains("Discarded 0 of 0"), "{}", none.body);
}

/// Resume: a halted group once, then `not halted`; revive: a row that is not dead.
fn resume_and_revive_refuse_what_is_not_there<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    store
        .record_halt(&ClaimInvariantViolated {
            group: group(GROUP),
            key: MessageKey::new("k-h").unwrap(),
            detail: "<script>claim gone</script>".to_owned(),
        })
        .unwrap();
    let mut b = Browser::new(Console::new(Operator::new(&store)).router());
    let page = b.get("/halts");
    assert!(page.body.contains("&lt;script&gt;claim gone"));
    let ok = b.post_raw(
        "/halts/resume",
        &[
            ("group", GROUP),
            ("confirm", "yes"),
            ("csrf", &b.csrf.clone().unwrap()),
        ],
        Some("http://127.0.0.1:8080"),
        "application/json",
    );
    assert_eq!(ok.status, StatusCode::OK);
    assert_eq!(ok.json()["resumed"], true);
    let again = b.post("/halts/resume", &[("group", GROUP), ("confirm", "yes")]);
    assert_eq!(again.status, StatusCode::NOT_FOUND);
    assert!(again.body.contains("not halted"));
    let bad = b.post("/halts/resume", &[("group", "no:such"), ("confirm", "yes")]);
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let revive = b.post("/outbox/revive", &[("id", "77"), ("confirm", "yes")]);
    assert_eq!(revive.status, StatusCode::CONFLICT);
    assert!(revive.body.contains("not dead"));
}

/// Every action is logged with who asked (the identity header) and what it did.
fn actions_are_logged_with_who_asked<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let id = dead_letter(&store, "k-7", usage_body(), &[]);
    let logs = Arc::new(Mutex::new(Vec::<u8>::new()));
    let sink = Arc::clone(&logs);
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || Writer(Arc::clone(&sink)))
        .with_ansi(false)
        .finish();
    let app = Console::new(Operator::new(&store))
        .identity_header("x-remote-user")
        .router();
    tracing::subscriber::with_default(subscriber, || {
        let mut b = Browser::new(app);
        b.get(&format!("/letters/{id}"));
        let req = b
            .request("POST", &format!("/letters/{id}/discard"))
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(header::ORIGIN, "http://127.0.0.1:8080")
            .header("x-remote-user", "ada@example.com")
            .body(Body::from(format!(
                "confirm=yes&csrf={}",
                b.csrf.clone().unwrap()
            )))
            .unwrap();
        assert_eq!(b.send(req).status, StatusCode::OK);
    });
    let text = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("who=ada@example.com")
            && text.contains("action=\"discard\"")
            && text.contains(&format!("letter={id}"))
            && text.contains("outcome=discarded"),
        "{text}"
    );
}

struct Writer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Mounted under a path, every link and the cookie follow it.
fn a_mounted_console_links_under_its_path<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let id = dead_letter(&store, "k-8", usage_body(), &[]);
    let app = Router::new().nest("/ops/inbox", Console::new(Operator::new(&store)).router());
    let mut b = Browser::new(app);
    let first = b.get("/ops/inbox");
    assert_eq!(first.status, StatusCode::OK);
    assert!(
        first.body.contains("href=\"/ops/inbox\""),
        "the overview's link"
    );
    assert!(
        first.headers[header::SET_COOKIE]
            .to_str()
            .unwrap()
            .contains("Path=/ops/inbox;"),
        "{:?}",
        first.headers
    );
    b.get(&format!("/ops/inbox/letters/{id}"));
    let page = b.get("/ops/inbox/letters");
    assert_eq!(page.status, StatusCode::OK);
    assert!(
        page.body
            .contains(&format!("href=\"/ops/inbox/letters/{id}\"")),
        "{}",
        page.body
    );
    assert!(page.body.contains("href=\"/ops/inbox/assets/console.css\""));
    assert!(b.cookie.is_some());
    let css = b.get("/ops/inbox/assets/console.css");
    assert_eq!(css.headers[header::CONTENT_TYPE], "text/css; charset=utf-8");
    assert_eq!(
        b.post(
            &format!("/ops/inbox/letters/{id}/discard"),
            &[("confirm", "yes")]
        )
        .status,
        StatusCode::OK
    );
}

/// The overview counts what the store recorded: a dead letter in the last hour and
/// day of its group, a halt, the outbox; its chart is an SVG of numbers only.
fn the_overview_counts_the_last_hour_and_day<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let clock = Arc::new(ManualClock::new(
        Utc.with_ymd_and_hms(2026, 3, 1, 12, 0, 0).unwrap(),
    ));
    let store = store_with_clock(fx, Arc::clone(&clock));
    dead_letter(&store, "k-o1", usage_body(), &[]);
    dead_letter(&store, "k-o2", usage_body(), &[]);
    store
        .process_batch(
            &group(GROUP),
            &[Envelope::new(
                MessageKey::new("k-ok").unwrap(),
                "usage.recorded",
                usage_body(),
            )],
        )
        .unwrap();
    store
        .record_halt(&ClaimInvariantViolated {
            group: group(GROUP),
            key: MessageKey::new("k-o1").unwrap(),
            detail: "gone".to_owned(),
        })
        .unwrap();
    clock.advance(Duration::from_secs(90 * 60));
    let mut b = Browser::new(Console::new(Operator::new(&store)).router());
    let o = b.get_json("/").json();
    let g = &o["groups"][0];
    assert_eq!(g["consumer_group"], GROUP);
    assert_eq!(g["halted"], true);
    assert_eq!(
        g["dead_lettered_last_hour"]["count"], 0,
        "90 minutes ago: {o}"
    );
    assert_eq!(g["dead_lettered_last_day"]["count"], 2, "{o}");
    assert_eq!(g["processed_last_day"]["count"], 1, "{o}");
    assert_eq!(g["dead_lettered_last_day"]["at_least"], false);
    assert_eq!(o["halted"][0]["detail"], "gone");
    assert_eq!(o["outbox"]["backlog"], 0);
    assert_eq!(
        o["activity"]["groups"][0]["buckets"]
            .as_array()
            .unwrap()
            .len(),
        24
    );
    let page = b.get("/");
    assert!(page.body.contains("<svg id=\"chart\""), "{}", page.body);
    assert!(page.body.contains(">halted<"));
}

/// Without a token the console serves only loopback hosts and allowed origins' hosts:
/// a page of another site rebound to 127.0.0.1 gets nothing.
fn a_console_without_a_token_refuses_other_hosts<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let id = dead_letter(&store, "k-r", usage_body(), &[]);
    let mut b = Browser::new(Console::new(Operator::new(&store)).router());
    b.get(&format!("/letters/{id}"));
    let csrf = b.csrf.clone().unwrap();
    let rebound = |b: &mut Browser, method: &str, body: String| {
        let req = Request::builder()
            .method(method)
            .uri(format!("/letters/{id}/discard"))
            .header(header::HOST, "attacker.example:8080")
            .header(header::ORIGIN, "http://attacker.example:8080")
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(header::COOKIE, b.cookie.clone().unwrap())
            .body(Body::from(body))
            .unwrap();
        b.send(req)
    };
    let post = rebound(&mut b, "POST", format!("confirm=yes&csrf={csrf}"));
    assert_eq!(
        post.status,
        StatusCode::MISDIRECTED_REQUEST,
        "{}",
        post.body
    );
    let get = rebound(&mut b, "GET", String::new());
    assert_eq!(get.status, StatusCode::MISDIRECTED_REQUEST);
    assert!(!get.body.contains("k-r"));
    assert_eq!(status_of(&store, id), LetterStatus::Pending);
    // A public name, once allowed, is served.
    let mut named = Browser::new(
        Console::new(Operator::new(&store))
            .allow_origin("https://ops.example.com")
            .router(),
    );
    let req = Request::builder()
        .uri("/")
        .header(header::HOST, "ops.example.com")
        .body(Body::empty())
        .unwrap();
    assert_eq!(named.send(req).status, StatusCode::OK);
    // With a token the host is not the guard: the token is.
    let mut tokened = Browser::new(Console::new(Operator::new(&store)).token("t").router());
    let req = Request::builder()
        .uri("/")
        .header(header::HOST, "anything.example")
        .body(Body::empty())
        .unwrap();
    assert_eq!(tokened.send(req).status, StatusCode::SEE_OTHER);
}

/// A failure group's bulk action keeps the page's consumer group: the letters of the
/// same failure in another group are left alone, and the confirmation says so.
fn a_bulk_action_keeps_the_pages_consumer_group<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    dead_letter(&store, "k-g1", usage_body(), &[]);
    let env = Envelope::new(
        MessageKey::new("k-g2").unwrap(),
        "usage.recorded",
        usage_body(),
    );
    store.process_batch(&group(OTHER), &[env]).unwrap();
    let op = Operator::new(&store);
    let ours = op
        .list_dead_letters(&DeadLetterFilter::default().consumer_group(GROUP), 0, 1)
        .unwrap();
    let fp = ours[0].failure_group.clone();
    let mut b = Browser::new(Console::new(Operator::new(&store)).router());
    let page = b.get(&format!("/failures?consumer_group={GROUP}"));
    assert!(
        page.body
            .contains(&format!("name=\"consumer_group\" value=\"{GROUP}\"")),
        "{}",
        page.body
    );
    let ask = b.post(
        &format!("/failures/{fp}/discard"),
        &[("consumer_group", GROUP)],
    );
    assert!(
        ask.body.contains(&format!("in consumer group {GROUP}")),
        "{}",
        ask.body
    );
    let done = b.post(
        &format!("/failures/{fp}/discard"),
        &[("consumer_group", GROUP), ("confirm", "yes")],
    );
    assert!(done.body.contains("Discarded 1 of 1"), "{}", done.body);
    let theirs = op
        .list_dead_letters(&DeadLetterFilter::default().consumer_group(OTHER), 0, 5)
        .unwrap();
    assert_eq!(theirs.len(), 1, "the other group's letter is left alone");
    assert_eq!(theirs[0].status, LetterStatus::Pending);
}

/// A form that does not parse is a 400 with `{"error"}`, nothing changed; thousands of
/// failure groups list the largest 200.
fn bad_forms_and_many_failure_groups_are_bounded<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let id = dead_letter(&store, "k-f", usage_body(), &[]);
    let mut b = Browser::new(Console::new(Operator::new(&store)).router());
    b.get(&format!("/letters/{id}"));
    let csrf = b.csrf.clone().unwrap();
    let twice = b.post_raw(
        &format!("/letters/{id}/discard"),
        &[("csrf", &csrf), ("confirm", "yes"), ("confirm", "yes")],
        Some("http://127.0.0.1:8080"),
        "application/json",
    );
    assert_eq!(twice.status, StatusCode::BAD_REQUEST, "{}", twice.body);
    assert!(twice.json()["error"]
        .as_str()
        .unwrap()
        .contains("does not parse"));
    assert_eq!(status_of(&store, id), LetterStatus::Pending);
    let letters = b'a'..=b'z';
    let mut n = 0;
    'outer: for x in letters.clone() {
        for y in letters.clone() {
            let word = format!("word-{}{}", x as char, y as char);
            dead_letter(&store, &word, usage_body(), &[]);
            n += 1;
            if n == 205 {
                break 'outer;
            }
        }
    }
    let groups = b.get_json("/failures").json();
    assert_eq!(groups["failure_groups"].as_array().unwrap().len(), 200);
    assert!(b
        .get("/failures")
        .body
        .contains("The largest 200 failure groups are shown"));
    assert_eq!(
        Operator::new(&store)
            .failure_groups(&DeadLetterFilter::default())
            .unwrap()
            .len(),
        206
    );
}

/// Stored rebuild and audit reports are listed newest first, per projection when
/// asked, their errors and drift samples escaped; JSON keeps them exactly.
fn rebuild_reports_are_listed_escaped<F: Fixture>(fx: &F)
where
    F::Conn: FullConnection,
{
    let store = store(fx);
    let insert = |projection: &str,
                  kind: &str,
                  outcome: &str,
                  error: &str,
                  differing: u32,
                  sample: &str| {
        fx.execute(&format!(
            "INSERT INTO inbox_rebuild_reports (projection, kind, started_at, finished_at, outcome, error, \
             partitions, rows_checked, rows_differing, rows_changed, extra_rows, events_covered, claims_recorded, \
             claims_converted, dead_letters_resolved, largest_ratio, lock_waits, lock_timeouts, duration_ms, drift_sample) \
             VALUES ('{projection}', '{kind}', '2026-03-01T11:00:00Z', '2026-03-01T11:00:01Z', '{outcome}', {error}, \
             2, 10, {differing}, 0, 0, 0, 0, 0, 0, NULL, 0, 0, 1000, '{sample}')"
        ))
    };
    insert(
        "daily_usage",
        "audit",
        "ok",
        "NULL",
        1,
        r#"[{"partition":"2026-03-01","row":"<script>alert(1)</script>","projected":2.0,"recomputed":1.0}]"#,
    );
    insert(
        "<b>totals</b>",
        "rebuild",
        "failed",
        "'hook failed: <img src=x onerror=alert(1)>'",
        0,
        "[]",
    );
    let mut b = Browser::new(Console::new(Operator::new(&store)).router());
    let page = b.get("/rebuilds");
    assert_eq!(page.status, StatusCode::OK);
    for bad in ["<script>alert", "<img src", "<b>totals"] {
        assert!(!page.body.contains(bad), "raw {bad:?}: {}", page.body);
    }
    assert!(
        page.body.contains("&lt;img src=x onerror=alert(1)&gt;"),
        "{}",
        page.body
    );
    assert!(
        page.body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{}",
        page.body
    );
    let all = b.get_json("/rebuilds").json();
    let reports = all["rebuild_reports"].as_array().unwrap();
    assert_eq!(reports.len(), 2);
    assert_eq!(reports[0]["projection"], "<b>totals</b>", "newest first");
    assert_eq!(reports[0]["outcome"], "failed");
    assert_eq!(
        reports[0]["error"],
        "hook failed: <img src=x onerror=alert(1)>"
    );
    assert_eq!(reports[1]["kind"], "audit");
    assert_eq!(reports[1]["rows_differing"], 1);
    let one = b.get_json("/rebuilds?projection=daily_usage").json();
    assert_eq!(one["rebuild_reports"].as_array().unwrap().len(), 1);
}

on_both_backends!(
    rebuild_reports_are_listed_escaped,
    a_console_without_a_token_refuses_other_hosts,
    a_bulk_action_keeps_the_pages_consumer_group,
    bad_forms_and_many_failure_groups_are_bounded,
    the_overview_counts_the_last_hour_and_day,
    every_page_renders_as_html_and_json,
    a_letter_is_confirmed_replayed_once_and_refused_after,
    actions_need_the_sessions_csrf_token_and_the_consoles_origin,
    read_only_refuses_every_action,
    a_token_console_needs_the_token,
    hostile_letters_render_escaped_and_bounded,
    a_bulk_action_is_bounded_and_counts,
    resume_and_revive_refuse_what_is_not_there,
    actions_are_logged_with_who_asked,
    a_mounted_console_links_under_its_path,
);

#[test]
fn the_standalone_server_needs_a_token_off_loopback() {
    let fx = inbox_test_support::SqliteFixture::new();
    let store = fx.builder().build().unwrap();
    let console = || Console::new(Operator::new(&store));
    let public: std::net::SocketAddr = "0.0.0.0:8080".parse().unwrap();
    let local: std::net::SocketAddr = "127.0.0.1:8080".parse().unwrap();
    assert!(matches!(
        console().check_listen(public),
        Err(inbox_web::ConsoleError::TokenRequired(_))
    ));
    assert!(console().check_listen(local).is_ok());
    assert!(console().token("x").check_listen(public).is_ok());
    assert!(matches!(
        console().token("").check_listen(local),
        Err(inbox_web::ConsoleError::EmptyToken)
    ));
}
