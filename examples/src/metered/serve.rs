//! The HTTP listeners: an accept loop of the service's own over hyper's HTTP/1
//! connection, so that a client cannot hold the service's descriptors.
//!
//! - **Connection cap**: a connection is accepted only with one of
//!   `max_connections` permits in hand; past the cap the loop stops accepting and
//!   new connections wait in the kernel's backlog (they hold no descriptor of the
//!   process) until a connection closes.
//! - **Header timeout** (hyper's `header_read_timeout`): a connection must send a
//!   request's whole head within it, counted from when the connection opens and,
//!   on a kept-alive connection, from the end of the previous response; else it is
//!   closed. A slowloris client and an idle kept-alive socket both end there.
//! - **Idle timeout**: while a read or a write waits on the client, the connection
//!   is closed after that long without progress in either direction (a request
//!   body that stalls, a client that stops reading its stream).
//!
//! `tests/metered_api.rs` holds each: `idle_and_slow_clients_are_closed_and_health_still_answers`
//! and `connections_past_the_cap_wait_in_the_backlog`.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use inbox_amqp::CancellationToken;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};

use super::log::Escaped;
use super::meter::{self, Count};

/// How one listener treats its connections.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Open connections at most.
    pub max_connections: usize,
    /// See the module docs.
    pub header_timeout: Duration,
    /// See the module docs.
    pub idle_timeout: Duration,
}

/// A listener's connection counters, for `GET /admin/stats` and `GET /metrics`
/// (`metered_api_connections_accepted_total{listener}`,
/// `metered_api_connections_open{listener}`).
#[derive(Debug)]
pub struct ConnectionStats {
    /// Connections accepted so far.
    pub accepted: Count,
    /// Connections open now.
    pub open: AtomicU64,
    /// The most connections that were open at once.
    pub peak: AtomicU64,
    open_gauge: metrics::Gauge,
}

impl ConnectionStats {
    /// The counters of the listener named `listener` (`public`, `admin`), registered
    /// with the recorder installed now (install it first).
    pub fn new(listener: &'static str) -> Self {
        Self {
            accepted: Count::new(meter::CONNECTIONS_ACCEPTED_TOTAL, &[("listener", listener)]),
            open: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            open_gauge: metrics::gauge!(meter::CONNECTIONS_OPEN, "listener" => listener),
        }
    }

    fn opened(&self) {
        self.accepted.add(1);
        let open = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(open, Ordering::Relaxed);
        self.open_gauge.increment(1.0);
    }

    fn closed(&self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        self.open_gauge.decrement(1.0);
    }
}

/// Serves `router` on `listener` until `shutdown`, then waits for the open
/// connections to finish what they are sending (each is told to close after its
/// response in flight).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stats: Arc<ConnectionStats>,
    shutdown: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        // The permit comes first: past the cap, nothing more is accepted.
        let permit = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            () = shutdown.cancelled() => break,
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // Out of descriptors (EMFILE) or a connection reset before it was
                // accepted: wait a little rather than spin.
                tracing::warn!(error = %Escaped(&err.to_string()), "accepting a connection failed");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(100)) => {}
                    () = shutdown.cancelled() => break,
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        stats.opened();
        let (router, stats, shutdown) = (router.clone(), Arc::clone(&stats), shutdown.clone());
        tokio::spawn(async move {
            connection(stream, peer, router, limits, shutdown).await;
            stats.closed();
            drop(permit);
        });
    }
    // Every permit back: every connection has ended.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
}

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let io = TokioIo::new(IdleTimeout::new(stream, limits.idle_timeout));
    let service = hyper::service::service_fn(move |mut req: axum::http::Request<Incoming>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        let mut router = router.clone();
        async move { tower_service::Service::call(&mut router, req).await }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(io, service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// A socket that fails with `TimedOut` when a read or a write has waited
/// `timeout` since the last progress in either direction.
struct IdleTimeout {
    io: TcpStream,
    timeout: Duration,
    sleep: Pin<Box<Sleep>>,
}

impl IdleTimeout {
    fn new(io: TcpStream, timeout: Duration) -> Self {
        Self {
            io,
            timeout,
            sleep: Box::pin(tokio::time::sleep(timeout)),
        }
    }

    fn progress(&mut self) {
        let deadline = Instant::now() + self.timeout;
        self.sleep.as_mut().reset(deadline);
    }

    fn waiting<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection idle past the idle timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for IdleTimeout {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                if buf.filled().len() > before {
                    this.progress();
                }
                Poll::Ready(result)
            }
            Poll::Pending => this.waiting(cx),
        }
    }
}

impl AsyncWrite for IdleTimeout {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write(cx, buf) {
            Poll::Ready(result) => {
                if matches!(result, Ok(n) if n > 0) {
                    this.progress();
                }
                Poll::Ready(result)
            }
            Poll::Pending => this.waiting(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write_vectored(cx, bufs) {
            Poll::Ready(result) => {
                if matches!(result, Ok(n) if n > 0) {
                    this.progress();
                }
                Poll::Ready(result)
            }
            Poll::Pending => this.waiting(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_flush(cx) {
            Poll::Ready(result) => Poll::Ready(result),
            Poll::Pending => this.waiting(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
