//! The HTTP interface (see the README's "Metered API" section for the contract):
//! `/v1` on the public listener, `/admin` on a listener of its own (loopback by
//! default) where every request carries the admin token.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::json;

use super::db;
use super::meter::Count;

use super::app::App;
use super::app::{authenticate, blocking, digest, hex, parse_json, ApiError, ApiResult};

fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

/// The public routes (`/v1`); `/admin` is not among them.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/balance", get(balance))
        .route("/v1/speech", post(super::speech::speech))
        .fallback(|| async { not_found() })
        .with_state(app)
}

/// The admin routes, for the admin listener: each request needs
/// `Authorization: Bearer <METERED_ADMIN_TOKEN>` (401 `unauthorized` otherwise,
/// before any route runs).
pub fn admin_router(app: Arc<App>) -> Router {
    Router::new()
        .route("/admin/accounts", post(create_account))
        .route("/admin/accounts/{id}", get(show_account))
        .route("/admin/keys", post(create_key))
        .route("/admin/usage/{id}", get(show_usage))
        .route("/admin/usage/{id}/refund", post(refund_usage))
        .route("/admin/stats", get(stats))
        .merge(crate::scrape::metrics_router(app.metrics.clone()))
        .fallback(|| async { not_found() })
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&app),
            require_admin_token,
        ))
        .with_state(app)
}

/// Refuses an admin request without the admin token (compared in constant time).
async fn require_admin_token(
    State(app): State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        Some(token) if app.config.admin_token.matches(token) => next.run(request).await,
        _ => {
            app.stats.admin_unauthorized.add(1);
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "expected Authorization: Bearer <admin token>",
            )
            .into_response()
        }
    }
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
    let count = |c: &Count| c.get();
    axum::Json(json!({
        "redis_fallbacks": a.fallbacks(),
        "rate_limit_fallbacks": count(&a.rate_limit_fallbacks),
        "slot_fallbacks": count(&a.slot_fallbacks),
        "key_cache_fallbacks": count(&a.key_cache_fallbacks),
        "key_cache_hits": count(&a.key_cache_hits),
        "key_cache_misses": count(&a.key_cache_misses),
        "streams_delivered": count(&app.stats.delivered),
        "streams_refunded": count(&app.stats.refunded),
        "refund_failures": count(&app.stats.refund_failures),
        "replays": count(&app.stats.replays),
        "auth_rate_limited": count(&app.stats.auth_rate_limited),
        "admin_unauthorized": count(&app.stats.admin_unauthorized),
        "connections_accepted": count(&app.connections.accepted),
        "connections_open": load(&app.connections.open),
        "connections_peak": load(&app.connections.peak),
        "settlements_refunded": count(&app.settlements.refunded),
        "settlements_already_settled": count(&app.settlements.already_settled),
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

async fn balance(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let caller = authenticate(&app, &headers, peer.ip()).await?;
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
