//! `POST /v1/speech`: authenticate, limit, begin the idempotent request, debit, and
//! hand the stream to its job; or serve a saved response.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use chrono::Utc;
use inbox_core::delta;
use inbox_core::idempotency::{
    IdempotencyAnswer, IdempotencyKey, IdempotencyStatus, RequestFields,
};
use inbox_diesel::idempotency::NewRequest;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::app::{authenticate, blocking, parse_json, ApiError, ApiResult, App, Caller};
use super::db::{self, Debit, DebitError};
use super::redis::Verdict;
use super::stream::{error_line, StreamJob};
use super::upstream;

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

/// The handler of `POST /v1/speech`.
pub async fn speech(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let started = Instant::now();
    let caller = authenticate(&app, &headers, peer.ip()).await?;
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
            inbox_diesel::idempotency::begin_request(conn, &request, now)
                .map_err(ApiError::internal)
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
                let _ = inbox_diesel::idempotency::abandon_request(
                    conn,
                    &account.to_string(),
                    key,
                    *token,
                );
            }
        }
        Ok(outcome)
    })
    .await?;
    let usage = debited.map_err(|e| match e {
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
        other @ (DebitError::Encode(_) | DebitError::Store(_)) => {
            ApiError::internal(inbox_core::ErrorChain(&other))
        }
    })?;

    let (tx, rx) = mpsc::channel(16);
    let usage_id = usage.usage_id;
    let job = StreamJob {
        app: Arc::clone(app),
        tx,
        usage,
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
    app.stats.replays.add(1);
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
            inbox_diesel::idempotency::read_request(conn, &account.to_string(), &key)
                .map_err(ApiError::internal)
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
