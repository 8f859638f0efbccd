//! The HTTP interface (see the README's "Metered API" section for the contract).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use chrono::Utc;
use diesel::PgConnection;
use inbox_core::{delta, IdempotencyAnswer, IdempotencyKey, IdempotencyStatus, RequestFields};
use inbox_diesel::{NewRequest, Store};
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::config::Config;
use super::db::{self, Debit, DebitError};
use super::redis::{Advisory, CacheLookup, Verdict};
use super::settle::SettlementStats;
use super::upstream::{self, Chunk};

/// Counters of the request path, for `GET /admin/stats`.
#[derive(Debug, Default)]
pub struct ServiceStats {
    /// Streams that ended with their final line, delivered.
    pub delivered: AtomicU64,
    /// Streams cut (upstream failure, deadline, client gone) and refunded.
    pub refunded: AtomicU64,
    /// Refunds that failed on the request path (the settlement refunds them later).
    pub refund_failures: AtomicU64,
    /// Replays served from a saved response.
    pub replays: AtomicU64,
}

/// Everything a request needs.
pub struct App {
    /// The settings.
    pub config: Config,
    /// The PostgreSQL store (pool, clock, outbox, idempotency records).
    pub store: Store<PgConnection>,
    /// Redis, advisory only.
    pub advisory: Advisory,
    /// The settlement consumer's counters.
    pub settlements: Arc<SettlementStats>,
    /// The request path's counters.
    pub stats: ServiceStats,
    /// The exchange settlement messages are published to.
    pub exchange: String,
}

/// An error answer: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    fn internal(err: impl std::fmt::Display) -> Self {
        tracing::error!(error = %err, "request failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the server failed; nothing was charged unless a usage id was reported",
        )
    }

    fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "expected Authorization: Bearer <api key> with an active key",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        (self.status, axum::Json(body)).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// Runs `f` on a pooled connection on a blocking thread.
async fn blocking<T, F>(app: &Arc<App>, f: F) -> ApiResult<T>
where
    T: Send + 'static,
    F: FnOnce(&mut PgConnection) -> ApiResult<T> + Send + 'static,
{
    let app = Arc::clone(app);
    tokio::task::spawn_blocking(move || {
        let mut conn = app.store.connection().map_err(|e| {
            tracing::error!(error = %e, "no database connection");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "database_unavailable",
                "the database is unavailable",
            )
        })?;
        f(&mut conn)
    })
    .await
    .map_err(ApiError::internal)?
}

fn parse_json<T: for<'de> Deserialize<'de>>(body: &[u8]) -> ApiResult<T> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// The service's routes.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/admin/accounts", post(create_account))
        .route("/admin/accounts/{id}", get(show_account))
        .route("/admin/keys", post(create_key))
        .route("/admin/usage/{id}", get(show_usage))
        .route("/admin/usage/{id}/refund", post(refund_usage))
        .route("/admin/stats", get(stats))
        .route("/v1/health", get(health))
        .route("/v1/balance", get(balance))
        .route("/v1/speech", post(speech))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .with_state(app)
}

#[derive(Deserialize)]
struct NewAccount {
    balance: i64,
}

async fn create_account(State(app): State<Arc<App>>, body: Bytes) -> ApiResult<Response> {
    let req: NewAccount = parse_json(&body)?;
    if req.balance < 0 {
        return Err(ApiError::bad_request("balance must be 0 or more"));
    }
    let now = app.store.clock().now();
    let id = blocking(&app, move |conn| {
        db::create_account(conn, req.balance, now).map_err(ApiError::internal)
    })
    .await?;
    Ok(axum::Json(json!({"account_id": id})).into_response())
}

async fn show_account(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Response> {
    let id: i64 = id
        .parse()
        .map_err(|_| ApiError::bad_request("the account id must be an integer"))?;
    let summary = blocking(&app, move |conn| {
        db::account_summary(conn, id).map_err(ApiError::internal)
    })
    .await?
    .ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "account_not_found",
            "no such account",
        )
    })?;
    Ok(axum::Json(json!({
        "account_id": summary.account_id,
        "balance": summary.balance,
        "ledger_sum": summary.ledger_sum,
        "ledger_entries": summary.ledger_entries,
        "refunds": summary.refunds,
    }))
    .into_response())
}

#[derive(Deserialize)]
struct NewKey {
    account_id: i64,
    spend_cap: i64,
}

/// 24 random bytes from the kernel, hex: `mk_` + 48 hex digits.
fn new_api_key() -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 24];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(format!("mk_{}", hex(&bytes)))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn digest(api_key: &str) -> Vec<u8> {
    Sha256::digest(api_key.as_bytes()).to_vec()
}

async fn create_key(State(app): State<Arc<App>>, body: Bytes) -> ApiResult<Response> {
    let req: NewKey = parse_json(&body)?;
    if req.spend_cap < 0 {
        return Err(ApiError::bad_request("spend_cap must be 0 or more"));
    }
    let api_key = new_api_key().map_err(ApiError::internal)?;
    let key_digest = digest(&api_key);
    let now = app.store.clock().now();
    let created = blocking(&app, move |conn| {
        db::create_key(conn, req.account_id, &key_digest, req.spend_cap, now)
            .map_err(ApiError::internal)
    })
    .await?;
    match created {
        Some(key_id) => {
            Ok(axum::Json(json!({"api_key": api_key, "key_id": key_id})).into_response())
        }
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "account_not_found",
            format!("no account {}", req.account_id),
        )),
    }
}

async fn show_usage(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Response> {
    let id: i64 = id
        .parse()
        .map_err(|_| ApiError::bad_request("the usage id must be an integer"))?;
    let usage = blocking(&app, move |conn| {
        db::usage(conn, id).map_err(ApiError::internal)
    })
    .await?
    .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "usage_not_found", "no such usage"))?;
    Ok(axum::Json(json!({
        "usage_id": usage.id,
        "account_id": usage.account_id,
        "amount": usage.amount,
        "model": usage.model,
        "status": usage.status,
        "refunds": usage.refunds,
    }))
    .into_response())
}

/// An operator's refund of a delivered usage.
async fn refund_usage(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Response> {
    let id: i64 = id
        .parse()
        .map_err(|_| ApiError::bad_request("the usage id must be an integer"))?;
    let now = app.store.clock().now();
    let (refunded, usage) = blocking(&app, move |conn| {
        let refunded = db::refund_delivered(conn, id, now).map_err(ApiError::internal)?;
        Ok((refunded, db::usage(conn, id).map_err(ApiError::internal)?))
    })
    .await?;
    let usage = usage
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "usage_not_found", "no such usage"))?;
    if !refunded {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_refundable",
            format!("usage {id} is {}, not delivered", usage.status),
        ));
    }
    Ok(axum::Json(json!({"usage_id": usage.id, "status": usage.status})).into_response())
}

async fn stats(State(app): State<Arc<App>>) -> Response {
    let a = &app.advisory.stats;
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    axum::Json(json!({
        "redis_fallbacks": a.fallbacks(),
        "rate_limit_fallbacks": load(&a.rate_limit_fallbacks),
        "slot_fallbacks": load(&a.slot_fallbacks),
        "key_cache_fallbacks": load(&a.key_cache_fallbacks),
        "key_cache_hits": load(&a.key_cache_hits),
        "key_cache_misses": load(&a.key_cache_misses),
        "streams_delivered": load(&app.stats.delivered),
        "streams_refunded": load(&app.stats.refunded),
        "refund_failures": load(&app.stats.refund_failures),
        "replays": load(&app.stats.replays),
        "settlements_refunded": load(&app.settlements.refunded),
        "settlements_already_settled": load(&app.settlements.already_settled),
    }))
    .into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let redis = app.advisory.redis().probe().await;
    let postgres = blocking(&app, |conn| {
        use diesel::connection::SimpleConnection;
        conn.batch_execute("SELECT 1").map_err(ApiError::internal)
    })
    .await
    .is_ok();
    let status = if postgres {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if postgres && redis { "ok" } else if postgres { "degraded" } else { "unavailable" },
        "postgres": if postgres { "ok" } else { "unavailable" },
        "redis": if redis { "ok" } else { "unavailable" },
        "redis_fallbacks": app.advisory.stats.fallbacks(),
    });
    (status, axum::Json(body)).into_response()
}

/// The caller: an active API key, looked up in the cache, else in PostgreSQL.
struct Caller {
    raw_key: String,
    account: i64,
    key_id: i64,
}

async fn authenticate(app: &Arc<App>, headers: &HeaderMap) -> ApiResult<Caller> {
    let raw_key = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(ApiError::unauthorized)?
        .to_owned();
    let key_digest = digest(&raw_key);
    let digest_hex = hex(&key_digest);
    let lookup = app.advisory.cached_key(&digest_hex).await;
    if let CacheLookup::Hit { account, key_id } = lookup {
        return Ok(Caller {
            raw_key,
            account,
            key_id,
        });
    }
    let found = blocking(app, move |conn| {
        db::find_key(conn, &key_digest).map_err(ApiError::internal)
    })
    .await?;
    let (account, key_id) = found.ok_or_else(ApiError::unauthorized)?;
    if lookup == CacheLookup::Miss {
        app.advisory.cache_key(&digest_hex, account, key_id).await;
    }
    Ok(Caller {
        raw_key,
        account,
        key_id,
    })
}

async fn balance(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult<Response> {
    let caller = authenticate(&app, &headers).await?;
    let key_id = caller.key_id;
    let b = blocking(&app, move |conn| {
        db::balance(conn, key_id).map_err(ApiError::internal)
    })
    .await?
    .ok_or_else(ApiError::unauthorized)?;
    Ok(axum::Json(json!({
        "account_id": b.account_id,
        "balance": b.balance,
        "spend_cap": b.spend_cap,
        "spent": b.spent,
    }))
    .into_response())
}

#[derive(Deserialize)]
struct SpeechRequest {
    text: String,
    #[serde(default)]
    model: Option<String>,
}

/// The longest text accepted, in characters.
pub const MAX_TEXT_CHARS: usize = 100_000;

/// The model when the request names none.
pub const DEFAULT_MODEL: &str = "standard";

fn valid_model(model: &str) -> bool {
    !model.is_empty()
        && model.len() <= 64
        && model
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
}

/// Holds a concurrency slot until the stream ends.
struct Slot {
    app: Arc<App>,
    account: i64,
    held: bool,
}

impl Slot {
    async fn release(mut self) {
        if self.held {
            self.held = false;
            self.app.advisory.release_slot(self.account).await;
        }
    }
}

async fn speech(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let started = Instant::now();
    let caller = authenticate(&app, &headers).await?;
    let req: SpeechRequest = parse_json(&body)?;
    let model = req.model.unwrap_or_else(|| DEFAULT_MODEL.to_owned());
    if !valid_model(&model) {
        return Err(ApiError::bad_request(
            "model must be 1 to 64 characters of [a-z0-9._-]",
        ));
    }
    let chars = req.text.chars().count();
    if chars == 0 || chars > MAX_TEXT_CHARS {
        return Err(ApiError::bad_request(format!(
            "text must be 1 to {MAX_TEXT_CHARS} characters, found {chars}"
        )));
    }
    let amount = i64::try_from(chars).map_err(ApiError::internal)?;
    let idempotency_key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => {
            let text = v.to_str().map_err(|_| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_idempotency_key",
                    "Idempotency-Key must be printable ASCII",
                )
            })?;
            Some(IdempotencyKey::new(text).map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_idempotency_key",
                    e.to_string(),
                )
            })?)
        }
    };

    let second = Utc::now().timestamp();
    if app
        .advisory
        .rate_limit(caller.key_id, app.config.rate_limit, second)
        .await
        == Verdict::Refused
    {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            format!(
                "more than {} requests per second on this key",
                app.config.rate_limit
            ),
        ));
    }
    let slot_ttl = app.config.deadline + app.config.settle_margin;
    let (verdict, held) = app
        .advisory
        .take_slot(caller.account, app.config.max_concurrency, slot_ttl)
        .await;
    if verdict == Verdict::Refused {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "concurrency_limited",
            format!(
                "the account already runs {} streams",
                app.config.max_concurrency
            ),
        ));
    }
    let slot = Slot {
        app: Arc::clone(&app),
        account: caller.account,
        held,
    };
    let result = execute(
        &app,
        &caller,
        req.text,
        model,
        amount,
        idempotency_key,
        started,
    )
    .await;
    match result {
        Ok(Execution::Stream(response, stream)) => {
            tokio::spawn(async move {
                stream.run().await;
                slot.release().await;
            });
            Ok(response)
        }
        Ok(Execution::Replay(response)) => {
            slot.release().await;
            Ok(response)
        }
        Err(e) => {
            slot.release().await;
            Err(e)
        }
    }
}

enum Execution {
    Stream(Response, StreamJob),
    Replay(Response),
}

fn ndjson(rx: mpsc::Receiver<Bytes>, usage_id: i64, replayed: bool) -> Response {
    let stream = futures_lite::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|line| (Ok::<_, Infallible>(line), rx))
    });
    let mut response = Response::new(Body::from_stream(stream));
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    if let Ok(v) = HeaderValue::from_str(&usage_id.to_string()) {
        h.insert("x-usage-id", v);
    }
    if replayed {
        h.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}

#[allow(clippy::too_many_arguments)]
async fn execute(
    app: &Arc<App>,
    caller: &Caller,
    text: String,
    model: String,
    amount: i64,
    idempotency_key: Option<IdempotencyKey>,
    started: Instant,
) -> ApiResult<Execution> {
    let clock = app.store.clock().clone();
    let now = clock.now();
    let deadline_at = now + delta(app.config.deadline);
    let account = caller.account;
    let caller_id = account.to_string();

    // The database decides who executes a key, not a cache.
    let mut token = None;
    if let Some(key) = &idempotency_key {
        let fingerprint = RequestFields::new()
            .field("text", &text)
            .and_then(|f| f.field("model", &model))
            .and_then(|f| f.field("amount", amount.to_string()))
            .map_err(ApiError::internal)?
            .fingerprint(caller.raw_key.as_bytes());
        let key2 = key.clone();
        let caller2 = caller_id.clone();
        let answer = blocking(app, move |conn| {
            let request = NewRequest {
                caller: &caller2,
                key: &key2,
                fingerprint: &fingerprint,
                lease_until: deadline_at,
            };
            inbox_diesel::begin_request(conn, &request, now).map_err(ApiError::internal)
        })
        .await?;
        match answer {
            IdempotencyAnswer::Execute { token: t } => token = Some(t),
            IdempotencyAnswer::Replay { response } => {
                return replay(app, account, key.clone(), amount, &model, response).await;
            }
            IdempotencyAnswer::InFlight => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "idempotency_in_flight",
                    "a request with this Idempotency-Key is in flight; retry after it settles",
                ))
            }
            IdempotencyAnswer::Refunded => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "idempotency_refunded",
                    "the request with this Idempotency-Key was refunded; use a new key",
                ))
            }
            IdempotencyAnswer::Mismatch => return Err(mismatch()),
            _ => return Err(ApiError::internal("unknown idempotency answer")),
        }
    }

    let settle_at = deadline_at + delta(app.config.settle_margin);
    let exchange = app.exchange.clone();
    let key_id = caller.key_id;
    let idem = idempotency_key.clone().zip(token);
    let model2 = model.clone();
    let debited = blocking(app, move |conn| {
        let d = Debit {
            account,
            key_id,
            amount,
            model: &model2,
            idempotency: idem.as_ref().map(|(k, t)| (k, *t)),
            deadline: deadline_at,
            settle_at,
            exchange: &exchange,
        };
        let now = clock.now();
        let outcome = db::debit(conn, &d, now);
        if let (Err(err), Some((key, token))) = (&outcome, &idem) {
            // Nothing committed: give the key back, unless another request holds it.
            if !matches!(err, DebitError::Fenced) {
                let _ = inbox_diesel::abandon_request(conn, &account.to_string(), key, *token);
            }
        }
        Ok(outcome)
    })
    .await?;
    let (usage_id, _balance) = debited.map_err(|e| match e {
        DebitError::InsufficientCredits => ApiError::new(
            StatusCode::PAYMENT_REQUIRED,
            "insufficient_credits",
            format!("the balance does not cover {amount} credits"),
        ),
        DebitError::SpendCapReached => ApiError::new(
            StatusCode::PAYMENT_REQUIRED,
            "spend_cap_reached",
            format!("{amount} credits would take this key over its spend cap"),
        ),
        DebitError::KeyInactive => ApiError::unauthorized(),
        DebitError::Fenced => ApiError::new(
            StatusCode::CONFLICT,
            "idempotency_in_flight",
            "another request took this Idempotency-Key over",
        ),
        DebitError::Store(e) => ApiError::internal(e),
    })?;

    let (tx, rx) = mpsc::channel(16);
    let job = StreamJob {
        app: Arc::clone(app),
        tx,
        usage_id,
        account,
        idempotency: idempotency_key.zip(token),
        chunks: upstream::chunks(&text),
        fail_after: upstream::fail_after(&text),
        amount,
        deadline: started + app.config.deadline,
    };
    Ok(Execution::Stream(ndjson(rx, usage_id, false), job))
}

fn mismatch() -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_mismatch",
        "this Idempotency-Key was used for another request (other content or API key)",
    )
}

/// Serves a saved response: every line but the last, then the record is checked
/// again, and the last line is sent only if the request is still delivered (a
/// refund that landed meanwhile ends the replay with an error line).
async fn replay(
    app: &Arc<App>,
    account: i64,
    key: IdempotencyKey,
    amount: i64,
    model: &str,
    response: Vec<u8>,
) -> ApiResult<Execution> {
    let key2 = key.clone();
    let usage = blocking(app, move |conn| {
        db::usage_by_key(conn, account, key2.as_str()).map_err(ApiError::internal)
    })
    .await?
    .ok_or_else(|| ApiError::internal("a delivered idempotency record has no usage row"))?;
    if usage.amount != amount || usage.model != model {
        return Err(mismatch());
    }
    app.stats.replays.fetch_add(1, Ordering::Relaxed);
    let mut lines: Vec<Bytes> = response
        .split_inclusive(|b| *b == b'\n')
        .map(Bytes::copy_from_slice)
        .collect();
    let last = lines.pop();
    let (tx, rx) = mpsc::channel(16);
    let app2 = Arc::clone(app);
    let usage_id = usage.id;
    let pace = app.config.chunk_delay;
    tokio::spawn(async move {
        // At the stream's own pace: a replay is served like the original.
        for line in lines {
            tokio::time::sleep(pace).await;
            if tx.send(line).await.is_err() {
                return;
            }
        }
        let still = blocking(&app2, move |conn| {
            inbox_diesel::read_request(conn, &account.to_string(), &key).map_err(ApiError::internal)
        })
        .await;
        let delivered = matches!(&still, Ok(Some(r)) if r.status == IdempotencyStatus::Delivered);
        let tail = match (delivered, last) {
            (true, Some(last)) => last,
            _ => error_line(
                "idempotency_refunded",
                "the request was refunded while its replay was served",
                usage_id,
                true,
            ),
        };
        let _ = tx.send(tail).await;
    });
    Ok(Execution::Replay(ndjson(rx, usage.id, true)))
}

fn line(value: serde_json::Value) -> Bytes {
    let mut bytes = value.to_string().into_bytes();
    bytes.push(b'\n');
    Bytes::from(bytes)
}

fn error_line(code: &str, message: &str, usage_id: i64, refunded: bool) -> Bytes {
    line(json!({
        "type": "error",
        "error": {"code": code, "message": message, "usage_id": usage_id},
        "refunded": refunded,
    }))
}

/// One debited request's stream: the upstream's chunks, then the settlement.
struct StreamJob {
    app: Arc<App>,
    tx: mpsc::Sender<Bytes>,
    usage_id: i64,
    account: i64,
    idempotency: Option<(IdempotencyKey, i64)>,
    chunks: Vec<Chunk>,
    fail_after: Option<usize>,
    amount: i64,
    deadline: Instant,
}

/// Why a stream was cut.
enum Cut {
    Upstream,
    Deadline,
    ClientGone,
}

impl StreamJob {
    async fn run(self) {
        let delay = self.app.config.chunk_delay;
        let mut sent = Vec::new();
        let mut cut = None;
        for (index, chunk) in self.chunks.iter().enumerate() {
            if self.fail_after == Some(index) {
                cut = Some(Cut::Upstream);
                break;
            }
            if !wait_until_deadline(delay, self.deadline).await {
                cut = Some(Cut::Deadline);
                break;
            }
            let l = line(json!({
                "type": "chunk",
                "index": index,
                "characters": chunk.characters,
                "audio": chunk.audio,
            }));
            sent.push(l.clone());
            if self.tx.send(l).await.is_err() {
                cut = Some(Cut::ClientGone);
                break;
            }
        }
        if cut.is_none() && self.fail_after.is_some() {
            // Failing after more chunks than there are: after the last one.
            cut = Some(Cut::Upstream);
        }
        match cut {
            None => self.finish(sent).await,
            Some(cut) => self.cut(cut).await,
        }
    }

    /// Marks the usage delivered (saving the whole body for replays) before the
    /// final line is sent.
    async fn finish(self, sent: Vec<Bytes>) {
        let last = line(json!({
            "type": "done",
            "usage_id": self.usage_id,
            "chunks": sent.len(),
            "characters": self.amount,
            "charged": self.amount,
        }));
        let mut body = Vec::new();
        for l in sent.iter().chain(std::iter::once(&last)) {
            body.extend_from_slice(l);
        }
        let usage_id = self.usage_id;
        let idem = self.idempotency.clone().map(|(k, t)| (self.account, k, t));
        let now = self.app.store.clock().now();
        let marked = blocking(&self.app, move |conn| {
            db::deliver(
                conn,
                usage_id,
                idem.as_ref().map(|(a, k, t)| (*a, k, *t)),
                &body,
                now,
            )
            .map_err(|e| {
                tracing::error!(usage_id, error = %e, "marking a usage delivered failed");
                ApiError::internal(e)
            })
        })
        .await;
        let tail = match marked {
            Ok(true) => {
                self.app.stats.delivered.fetch_add(1, Ordering::Relaxed);
                last
            }
            Ok(false) => error_line(
                "already_settled",
                "the request was settled (refunded) before it could be delivered",
                usage_id,
                true,
            ),
            Err(_) => error_line(
                "settlement_failed",
                "the delivery could not be recorded; the usage will be refunded by its settlement",
                usage_id,
                false,
            ),
        };
        let _ = self.tx.send(tail).await;
    }

    /// Refunds a cut stream (same lock order as the debit) and ends it with an error
    /// line. A refund that fails is loud: an error log and line with the usage id;
    /// the settlement message refunds it after the deadline.
    async fn cut(self, cut: Cut) {
        let (code, message) = match cut {
            Cut::Upstream => (
                "upstream_failed",
                "the upstream failed; the request was refunded",
            ),
            Cut::Deadline => (
                "deadline_exceeded",
                "the request ran past its deadline; it was cut and refunded",
            ),
            Cut::ClientGone => ("client_disconnected", "the client went away; refunded"),
        };
        let usage_id = self.usage_id;
        let now = self.app.store.clock().now();
        let refunded = blocking(&self.app, move |conn| {
            db::refund(conn, usage_id, now).map_err(ApiError::internal)
        })
        .await;
        let tail = match refunded {
            Ok(_) => {
                self.app.stats.refunded.fetch_add(1, Ordering::Relaxed);
                error_line(code, message, usage_id, true)
            }
            Err(_) => {
                self.app
                    .stats
                    .refund_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    usage_id,
                    "refund of a cut stream failed; its settlement message refunds it after \
                     the deadline"
                );
                error_line(
                    code,
                    "the stream was cut and its refund failed; it will be refunded by its settlement",
                    usage_id,
                    false,
                )
            }
        };
        let _ = self.tx.send(tail).await;
    }
}

/// Sleeps `delay`, or until the deadline if it comes first; false at the deadline.
async fn wait_until_deadline(delay: Duration, deadline: Instant) -> bool {
    let wake = Instant::now() + delay;
    if wake >= deadline {
        tokio::time::sleep_until(deadline).await;
        return false;
    }
    tokio::time::sleep_until(wake).await;
    true
}
