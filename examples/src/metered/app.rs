//! What the request handlers share: the application state, the API's error
//! responses, running database work off the async runtime, and authenticating the
//! caller. `http` routes to the handlers of `speech` and `stream`, which use this.

use std::net::IpAddr;
use std::sync::Arc;

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use diesel::PgConnection;
use inbox_diesel::Store;
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::auth_limit::AuthFailures;
use super::config::Config;
use super::db;
use super::log::escaped;
use super::meter::{self, Count};
use super::redis::{Advisory, CacheLookup};
use super::serve::ConnectionStats;
use super::settle::SettlementStats;

/// Counters of the request path, for `GET /admin/stats` and `GET /metrics`.
#[derive(Debug)]
pub struct ServiceStats {
    /// Streams that ended with their final line, delivered.
    pub delivered: Count,
    /// Streams cut (upstream failure, deadline, client gone) and refunded.
    pub refunded: Count,
    /// Refunds that failed on the request path (the settlement refunds them later).
    pub refund_failures: Count,
    /// Replays served from a saved response.
    pub replays: Count,
    /// Authentications refused because the client's address failed too often.
    pub auth_rate_limited: Count,
    /// Admin requests refused for a missing or wrong admin token.
    pub admin_unauthorized: Count,
}

impl Default for ServiceStats {
    /// Registers the counters with the recorder installed now (install it first).
    fn default() -> Self {
        Self {
            delivered: Count::new(meter::STREAMS_DELIVERED_TOTAL, &[]),
            refunded: Count::new(meter::STREAMS_REFUNDED_TOTAL, &[]),
            refund_failures: Count::new(meter::REFUND_FAILURES_TOTAL, &[]),
            replays: Count::new(meter::REPLAYS_TOTAL, &[]),
            auth_rate_limited: Count::new(meter::AUTH_RATE_LIMITED_TOTAL, &[]),
            admin_unauthorized: Count::new(meter::ADMIN_UNAUTHORIZED_TOTAL, &[]),
        }
    }
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
    /// Failed authentications per client address.
    pub auth_failures: AuthFailures,
    /// The public listener's connections.
    pub connections: Arc<ConnectionStats>,
    /// Renders `GET /metrics` (the process's Prometheus recorder).
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
}

/// An error answer: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    retry_after: Option<u64>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    pub(crate) fn internal(err: impl std::fmt::Display) -> Self {
        tracing::error!(error = %escaped(&err), "request failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the server failed; nothing was charged unless a usage id was reported",
        )
    }

    pub(crate) fn unauthorized() -> Self {
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
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

pub(crate) type ApiResult<T> = Result<T, ApiError>;

/// Runs `f` on a pooled connection on a blocking thread.
pub(crate) async fn blocking<T, F>(app: &Arc<App>, f: F) -> ApiResult<T>
where
    T: Send + 'static,
    F: FnOnce(&mut PgConnection) -> ApiResult<T> + Send + 'static,
{
    let app = Arc::clone(app);
    tokio::task::spawn_blocking(move || {
        let mut conn = app.store.connection().map_err(|e| {
            tracing::error!(error = %escaped(&e), "no database connection");
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

pub(crate) fn parse_json<T: for<'de> Deserialize<'de>>(body: &[u8]) -> ApiResult<T> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn digest(api_key: &str) -> Vec<u8> {
    Sha256::digest(api_key.as_bytes()).to_vec()
}

/// The caller: an active API key, looked up in the cache, else in PostgreSQL.
pub(crate) struct Caller {
    pub(crate) raw_key: String,
    pub(crate) account: i64,
    pub(crate) key_id: i64,
}

/// Finds the caller's key. An address whose bucket of failed authentications is
/// empty is refused (429 `auth_rate_limited`) before Redis or PostgreSQL is asked; a
/// key not found spends a token: see [`AuthFailures`].
pub(crate) async fn authenticate(
    app: &Arc<App>,
    headers: &HeaderMap,
    peer: IpAddr,
) -> ApiResult<Caller> {
    let raw_key = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(ApiError::unauthorized)?
        .to_owned();
    if !app.auth_failures.allows(peer) {
        app.stats.auth_rate_limited.add(1);
        let mut err = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "auth_rate_limited",
            "too many failed authentications from this address; retry later",
        );
        err.retry_after = Some(app.auth_failures.retry_after().as_secs());
        return Err(err);
    }
    let caller = look_up_key(app, raw_key).await;
    if let Err(err) = &caller {
        if err.code == "unauthorized" {
            app.auth_failures.failed(peer);
        }
    }
    caller
}

async fn look_up_key(app: &Arc<App>, raw_key: String) -> ApiResult<Caller> {
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
