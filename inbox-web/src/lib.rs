//! A web console for a transactional inbox's operators: failure groups, dead letters
//! (payload, headers, error, replay history), replay and discard, halted groups and
//! their resume, dead outbox rows and their revival, claims by key, rebuild reports,
//! and an overview per consumer group with a chart, as an [`axum::Router`] you mount
//! under a path of your own service, or run beside a consumer with `inbox web`.
//!
//! ```no_run
//! # async fn demo(store: inbox_diesel::Store<diesel::PgConnection>) -> Result<(), Box<dyn std::error::Error>> {
//! use inbox_diesel::operator::Operator;
//!
//! let console = inbox_web::Console::new(Operator::new(&store))
//!     .identity_header("x-remote-user"); // set by your auth layer
//! let app = axum::Router::new().nest("/ops", console.router());
//! // Wrap `app` (or the nested router) in YOUR authentication layer: the mounted
//! // console trusts whoever reaches it.
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```
//!
//! Every page is HTML, and JSON at the same path with `Accept: application/json` (the
//! field names of the `inbox` CLI's `--json`, from [`inbox_diesel::operator::json`]).
//! Every read and write goes through [`inbox_diesel::operator::Operator`]: this crate
//! holds no SQL, so every rule (a replay's guards, a bulk action's bound) is the
//! operator API's. The routes and their JSON are the contract in the workspace's
//! `docs/console.md`.
//!
//! # Safe by default
//!
//! A payload, key, header or error is hostile input. Every value is escaped by the
//! template (maud) for where it lands, payloads are shown bounded (pretty JSON, text
//! or hex), and every response carries a Content-Security-Policy with no script
//! source at all (`script-src 'none'`) and no inline style, `X-Frame-Options: DENY`,
//! `X-Content-Type-Options: nosniff` and `Cache-Control: no-store`.
//!
//! Every action is a `POST` that needs the CSRF token of the visitor's session (a
//! hidden form field) and is refused from another origin; it asks for a confirmation
//! first (a page saying what and how many it touches) and is logged at `info` on the
//! target `inbox_web::audit` with what it changed and who asked (the
//! [`identity_header`](Console::identity_header) your auth layer sets). A bulk action
//! touches at most [`max_bulk`](Console::max_bulk) letters per click and says how many.
//!
//! Two ways to admit a visitor:
//!
//! - **Mounted** (the default): your service's auth layer decides who reaches the
//!   router; it must have one. The console issues each visitor a session cookie that
//!   binds the CSRF token, and answers only requests whose `Host` is a loopback
//!   address, `localhost` or the host of an [`allow_origin`](Console::allow_origin)
//!   (421 otherwise), so that another site rebound to 127.0.0.1 (DNS rebinding) is
//!   never served as the console's origin.
//! - **Token** ([`Console::token`], the `inbox web` server's `INBOX_WEB_TOKEN`): a
//!   browser presents the token once on the login form and gets an `HttpOnly`,
//!   `SameSite=Strict` session cookie; a script sends `Authorization: Bearer <token>`
//!   (no cookie, so no CSRF token is needed). The token is compared in constant time.
//!   The `inbox web` server refuses a non-loopback address without one.
//!
//! [`read_only`](Console::read_only) refuses every action and shows no button.
#![forbid(unsafe_code)]

mod actions;
mod pages;
pub mod session;
mod view;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{NestedPath, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use inbox_diesel::operator::{OperatorConnection, ReplayTarget};
use maud::Markup;
use serde_json::json;

pub use inbox_diesel::operator::Operator;
use session::{Keys, Kind, Session, SESSION_COOKIE};

/// The largest number of letters a bulk action touches per click, by default.
pub const DEFAULT_MAX_BULK: usize = 1000;

/// The largest form a POST may carry.
const MAX_FORM_BYTES: usize = 16 * 1024;

/// The Content-Security-Policy of every response.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; img-src 'self'; \
     script-src 'none'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Why the `inbox web` server refuses to start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// An access token with leading or trailing white space (a secret file's
    /// newline): a browser's password field could never present it.
    #[error("the console's access token starts or ends with white space (a trailing newline?)")]
    TokenWhitespace,
    /// A non-loopback address without an access token.
    #[error(
        "refusing to serve the console on {0} without a token: set INBOX_WEB_TOKEN (or listen on a loopback address)"
    )]
    TokenRequired(std::net::SocketAddr),
    /// An empty access token.
    #[error("the console's access token is empty")]
    EmptyToken,
}

/// The console: what it shows, who may act, and how. Build it, then take its
/// [`router`](Self::router).
pub struct Console<C: OperatorConnection> {
    operator: Operator<C>,
    target: ReplayTarget,
    read_only: bool,
    identity_header: Option<header::HeaderName>,
    token: Option<String>,
    session_key: Option<Vec<u8>>,
    allowed_origins: Vec<String>,
    secure_cookie: bool,
    max_bulk: usize,
}

impl<C: OperatorConnection> std::fmt::Debug for Console<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("read_only", &self.read_only)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("max_bulk", &self.max_bulk)
            .finish_non_exhaustive()
    }
}

impl<C: OperatorConnection> Console<C> {
    /// A mounted console on this operator handle: actions allowed, no token (your
    /// auth layer admits visitors), replays to queues without a prefix.
    pub fn new(operator: Operator<C>) -> Self {
        Self {
            operator,
            target: ReplayTarget::default(),
            read_only: false,
            identity_header: None,
            token: None,
            session_key: None,
            allowed_origins: Vec::new(),
            secure_cookie: false,
            max_bulk: DEFAULT_MAX_BULK,
        }
    }

    /// Where replays go: the topology's queue prefix (as `inbox --prefix`).
    pub fn replay_target(mut self, target: ReplayTarget) -> Self {
        self.target = target;
        self
    }

    /// Refuses every action (403) and shows no action button.
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// The request header your auth layer sets to the user's name: logged with every
    /// action as who asked. Without it, or when a request lacks it, an action is logged
    /// as asked by `anonymous` (or `token` for a token session).
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    pub fn identity_header(mut self, name: &str) -> Self {
        self.identity_header = Some(
            header::HeaderName::from_bytes(name.as_bytes())
                .unwrap_or_else(|_| panic!("not a header name: {name:?}")),
        );
        self
    }

    /// Requires this access token: presented once on the login form (or as a bearer
    /// token), compared in constant time. Sessions are signed with a key derived from
    /// it, so replicas with the same token accept each other's sessions.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// The key sessions are signed with, shared by the replicas of a mounted console
    /// (without it, and without a token, each process signs with a random key and its
    /// sessions end with it).
    pub fn session_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.session_key = Some(key.into());
        self
    }

    /// An origin besides the request's own host that actions are accepted from
    /// (`https://ops.example.com`: the public name in front of a proxy). Without a
    /// token, the console answers only requests whose `Host` is a loopback address,
    /// `localhost`, or the host of such an origin: a mounted console served under a
    /// real name must name it here.
    pub fn allow_origin(mut self, origin: impl Into<String>) -> Self {
        self.allowed_origins.push(origin.into());
        self
    }

    /// Marks the session cookie `Secure` (the console is served over HTTPS).
    pub fn secure_cookie(mut self, secure: bool) -> Self {
        self.secure_cookie = secure;
        self
    }

    /// The most letters a bulk action (a failure group's replay or discard) touches per
    /// click; at least 1.
    pub fn max_bulk(mut self, max: usize) -> Self {
        self.max_bulk = max.max(1);
        self
    }

    /// Checks the console can serve on `addr` standalone: a non-loopback address needs
    /// a token, and a token is never empty.
    pub fn check_listen(&self, addr: std::net::SocketAddr) -> Result<(), ConsoleError> {
        match &self.token {
            Some(t) if t.is_empty() => Err(ConsoleError::EmptyToken),
            Some(t) if t.trim() != t => Err(ConsoleError::TokenWhitespace),
            None if !addr.ip().is_loopback() => Err(ConsoleError::TokenRequired(addr)),
            _ => Ok(()),
        }
    }

    /// The console's routes, to mount with [`Router::nest`] (links follow the mount
    /// path) or serve as they are.
    pub fn router(self) -> Router {
        let keys = Keys::new(self.token.as_deref(), self.session_key.as_deref());
        let inner = Arc::new(Inner {
            operator: self.operator,
            target: self.target,
            read_only: self.read_only,
            identity_header: self.identity_header,
            keys,
            allowed_origins: self.allowed_origins,
            secure_cookie: self.secure_cookie,
            max_bulk: self.max_bulk,
        });
        Router::new()
            .route("/", get(pages::overview::<C>))
            .route("/failures", get(pages::failures::<C>))
            .route(
                "/failures/{fingerprint}/replay",
                post(actions::replay_group::<C>),
            )
            .route(
                "/failures/{fingerprint}/discard",
                post(actions::discard_group::<C>),
            )
            .route("/letters", get(pages::letters::<C>))
            .route("/letters/{id}", get(pages::letter::<C>))
            .route("/letters/{id}/replay", post(actions::replay_letter::<C>))
            .route("/letters/{id}/discard", post(actions::discard_letter::<C>))
            .route("/halts", get(pages::halts::<C>))
            .route("/halts/resume", post(actions::resume::<C>))
            .route("/outbox", get(pages::outbox::<C>))
            .route("/outbox/revive", post(actions::revive::<C>))
            .route("/claims", get(pages::claims::<C>))
            .route("/rebuilds", get(pages::rebuilds::<C>))
            .route(
                "/login",
                get(pages::login_form::<C>).post(actions::login::<C>),
            )
            .route("/logout", post(actions::logout::<C>))
            .route("/assets/console.css", get(css))
            .fallback(not_found)
            .layer(axum::middleware::from_fn_with_state(
                Arc::clone(&inner),
                gate::<C>,
            ))
            .with_state(inner)
    }
}

/// What the handlers share.
pub(crate) struct Inner<C: OperatorConnection> {
    pub(crate) operator: Operator<C>,
    pub(crate) target: ReplayTarget,
    pub(crate) read_only: bool,
    identity_header: Option<header::HeaderName>,
    pub(crate) keys: Keys,
    allowed_origins: Vec<String>,
    pub(crate) secure_cookie: bool,
    pub(crate) max_bulk: usize,
}

pub(crate) type Shared<C> = State<Arc<Inner<C>>>;

/// What a request carries into its handler: where the console is mounted, whether it
/// wants JSON, its session and CSRF token, and who it is.
#[derive(Clone, Debug)]
pub(crate) struct Ctx {
    /// The mount path, no trailing slash (`""` at the root).
    pub(crate) base: String,
    pub(crate) json: bool,
    pub(crate) csrf: String,
    pub(crate) read_only: bool,
    pub(crate) logged_in: bool,
    pub(crate) who: String,
}

/// The overview's path: the mount path itself, or `/` at the root.
pub(crate) fn home(ctx: &Ctx) -> String {
    if ctx.base.is_empty() {
        "/".to_owned()
    } else {
        ctx.base.clone()
    }
}

/// An answer: a page or a JSON document, with a status.
pub(crate) fn answer(
    ctx: &Ctx,
    status: StatusCode,
    doc: serde_json::Value,
    page: impl FnOnce() -> Markup,
) -> Response {
    if ctx.json {
        (status, Json(doc)).into_response()
    } else {
        (status, axum::response::Html(page().into_string())).into_response()
    }
}

/// A refusal or failure, as a page or `{"error": ...}`.
pub(crate) fn problem(ctx: &Ctx, status: StatusCode, message: &str) -> Response {
    let title = status.canonical_reason().unwrap_or("error").to_owned();
    answer(ctx, status, json!({ "error": message }), || {
        view::page(
            ctx,
            &title,
            maud::html! {
                h1 { (title) }
                (view::notice(false, message))
            },
        )
    })
}

/// Runs an operator call off the async runtime (they block on the pool and the
/// database).
pub(crate) async fn blocking<C, T>(
    inner: &Arc<Inner<C>>,
    f: impl FnOnce(&Operator<C>) -> inbox_diesel::Result<T> + Send + 'static,
) -> Result<T, String>
where
    C: OperatorConnection,
    T: Send + 'static,
{
    let inner = Arc::clone(inner);
    match tokio::task::spawn_blocking(move || f(&inner.operator)).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => {
            tracing::warn!(error = %err, "console: the store failed");
            Err(err.to_string())
        }
        Err(_) => Err("the store call panicked".to_owned()),
    }
}

async fn css() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        view::CSS,
    )
        .into_response()
}

async fn not_found(ctx: axum::Extension<Ctx>) -> Response {
    problem(&ctx, StatusCode::NOT_FOUND, "no such page")
}

/// Whether a request asks for JSON: `Accept` names `application/json` and not
/// `text/html`.
fn wants_json(headers: &HeaderMap) -> bool {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    accept.contains("application/json") && !accept.contains("text/html")
}

fn header_str<'a>(headers: &'a HeaderMap, name: &header::HeaderName) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Every request passes here: admission (session, bearer token or login), the origin
/// and CSRF checks of a POST, read-only refusals, and the security headers of every
/// response.
async fn gate<C: OperatorConnection>(
    State(inner): Shared<C>,
    request: Request,
    next: Next,
) -> Response {
    let mut response = admit(&inner, request, next).await;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    if !h.contains_key(header::CONTENT_TYPE) {
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
    }
    response
}

async fn admit<C: OperatorConnection>(
    inner: &Arc<Inner<C>>,
    request: Request,
    next: Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    let base = parts
        .extensions
        .get::<NestedPath>()
        .map(|p| p.as_str().trim_end_matches('/').to_owned())
        .unwrap_or_default();
    let path = parts.uri.path().to_owned();
    let json = wants_json(&parts.headers);
    let mut ctx = Ctx {
        base: base.clone(),
        json,
        csrf: String::new(),
        read_only: inner.read_only,
        logged_in: false,
        who: "anonymous".to_owned(),
    };
    let cookie_path = if base.is_empty() {
        "/".to_owned()
    } else {
        base.clone()
    };
    let session = header_str(&parts.headers, &header::COOKIE)
        .and_then(|c| session::cookie(c, SESSION_COOKIE))
        .and_then(|v| inner.keys.verify(v))
        .filter(|s| inner.keys.token_required() == (s.kind == Kind::Login));
    let presented = header_str(&parts.headers, &header::AUTHORIZATION);
    let bearer = presented
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| inner.keys.token_matches(t.trim()));
    if presented.is_some() && !bearer && inner.keys.token_required() {
        tracing::warn!(target: "inbox_web::audit", path = %path, "console: a request with a wrong bearer token refused");
    }
    let public = path == "/login" || path == "/assets/console.css";
    let is_post = parts.method == Method::POST;

    // A console without a token serves only its own host names (DNS rebinding).
    if !inner.keys.token_required()
        && !session::host_allowed(
            header_str(&parts.headers, &header::HOST),
            &inner.allowed_origins,
        )
    {
        tracing::warn!(target: "inbox_web::audit", host = ?header_str(&parts.headers, &header::HOST), "console: a request for another host refused");
        return problem(
            &ctx,
            StatusCode::MISDIRECTED_REQUEST,
            "refused: this console without a token answers only for a loopback host or an allowed origin's (allow_origin, --allow-origin)",
        );
    }

    // Admission.
    let mut new_cookie = None;
    let session: Option<Session> = match session {
        Some(s) => Some(s),
        None if inner.keys.token_required() => {
            if !bearer && !public {
                return if json || is_post {
                    problem(
                        &ctx,
                        StatusCode::UNAUTHORIZED,
                        "log in first: present the console's token",
                    )
                } else {
                    Redirect::to(&format!("{base}/login")).into_response()
                };
            }
            None
        }
        None => {
            let (s, value) = inner.keys.issue(Kind::Visitor);
            new_cookie = Some(session::set_cookie(
                &value,
                &cookie_path,
                inner.secure_cookie,
            ));
            Some(s)
        }
    };
    if let Some(s) = &session {
        ctx.csrf = inner.keys.csrf(s);
        ctx.logged_in = s.kind == Kind::Login;
        if s.kind == Kind::Login {
            ctx.who = "token".to_owned();
        }
    } else if bearer {
        ctx.who = "bearer".to_owned();
    }
    if let Some(who) = inner
        .identity_header
        .as_ref()
        .and_then(|h| header_str(&parts.headers, h))
    {
        ctx.who = who.to_owned();
    }

    // A POST: its origin, its CSRF token (not for a bearer request: it carries no
    // cookie a browser would attach), and read-only mode.
    let mut body = body;
    if is_post {
        let origin_ok = session::same_origin(
            header_str(&parts.headers, &header::ORIGIN),
            parts
                .headers
                .get("sec-fetch-site")
                .and_then(|v| v.to_str().ok()),
            header_str(&parts.headers, &header::HOST),
            &inner.allowed_origins,
        );
        if !origin_ok {
            tracing::warn!(target: "inbox_web::audit", path = %path, "console: a POST from another origin refused");
            return problem(
                &ctx,
                StatusCode::FORBIDDEN,
                "refused: the request comes from another origin",
            );
        }
        if path != "/login" {
            if inner.read_only && path != "/logout" {
                return problem(
                    &ctx,
                    StatusCode::FORBIDDEN,
                    "refused: the console is read-only",
                );
            }
            let bytes = match axum::body::to_bytes(body, MAX_FORM_BYTES).await {
                Ok(b) => b,
                Err(_) => {
                    return problem(&ctx, StatusCode::PAYLOAD_TOO_LARGE, "the form is too large")
                }
            };
            if !bearer {
                let presented: Option<String> =
                    serde_urlencoded::from_bytes::<Vec<(String, String)>>(&bytes)
                        .ok()
                        .and_then(|fields| {
                            fields
                                .into_iter()
                                .find(|(k, _)| k == "csrf")
                                .map(|(_, v)| v)
                        });
                let valid = match (&session, presented) {
                    (Some(s), Some(p)) => inner.keys.csrf_matches(s, &p),
                    _ => false,
                };
                if !valid {
                    tracing::warn!(target: "inbox_web::audit", path = %path, who = %ctx.who, "console: a POST without a valid CSRF token refused");
                    return problem(
                        &ctx,
                        StatusCode::FORBIDDEN,
                        "refused: the form's CSRF token is missing or not this session's (reload the page)",
                    );
                }
            }
            body = Body::from(bytes);
        }
    }
    parts.extensions.insert(ctx);
    let mut response = next.run(Request::from_parts(parts, body)).await;
    if let Some(cookie) = new_cookie {
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            response.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    response
}
