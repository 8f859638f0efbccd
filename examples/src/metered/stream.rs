//! One debited request's stream: the simulated upstream's chunks, then the
//! settlement (delivered before the final line, or refunded before the error line).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use inbox_core::idempotency::IdempotencyKey;
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::app::{blocking, ApiError, App};
use super::db;
use super::upstream::Chunk;

pub(crate) fn line(value: serde_json::Value) -> Bytes {
    let mut bytes = value.to_string().into_bytes();
    bytes.push(b'\n');
    Bytes::from(bytes)
}

pub(crate) fn error_line(code: &str, message: &str, usage_id: i64, refunded: bool) -> Bytes {
    line(json!({
        "type": "error",
        "error": {"code": code, "message": message, "usage_id": usage_id},
        "refunded": refunded,
    }))
}

/// One debited request's stream: the upstream's chunks, then the settlement.
pub(crate) struct StreamJob {
    pub(crate) app: Arc<App>,
    pub(crate) tx: mpsc::Sender<Bytes>,
    /// The usage the request debited (settled by its id and `usage_ref`).
    pub(crate) usage: db::DebitedUsage,
    pub(crate) account: i64,
    pub(crate) idempotency: Option<(IdempotencyKey, inbox_core::idempotency::LeaseToken)>,
    pub(crate) chunks: Vec<Chunk>,
    pub(crate) fail_after: Option<usize>,
    pub(crate) amount: i64,
    pub(crate) deadline: Instant,
}

/// Why a stream was cut.
enum Cut {
    Upstream,
    Deadline,
    ClientGone,
}

impl StreamJob {
    pub(crate) async fn run(self) {
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
            "usage_id": self.usage.usage_id,
            "chunks": sent.len(),
            "characters": self.amount,
            "charged": self.amount,
        }));
        let mut body = Vec::new();
        for l in sent.iter().chain(std::iter::once(&last)) {
            body.extend_from_slice(l);
        }
        let (usage_id, usage) = (self.usage.usage_id, self.usage.clone());
        let idem = self.idempotency.clone().map(|(k, t)| (self.account, k, t));
        let now = self.app.store.clock().now();
        let marked = blocking(&self.app, move |conn| {
            db::deliver(
                conn,
                &usage,
                idem.as_ref().map(|(a, k, t)| (*a, k, *t)),
                &body,
                now,
            )
            .map_err(|e| {
                tracing::error!(usage_id, error = %super::log::escaped(&e), "marking a usage delivered failed");
                ApiError::internal(e)
            })
        })
        .await;
        let tail = match marked {
            Ok(true) => {
                self.app.stats.delivered.add(1);
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
        let (usage_id, usage) = (self.usage.usage_id, self.usage.clone());
        let now = self.app.store.clock().now();
        let refunded = blocking(&self.app, move |conn| {
            db::refund(conn, &usage, now).map_err(ApiError::internal)
        })
        .await;
        let tail = match refunded {
            Ok(_) => {
                self.app.stats.refunded.add(1);
                error_line(code, message, usage_id, true)
            }
            Err(_) => {
                self.app.stats.refund_failures.add(1);
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
