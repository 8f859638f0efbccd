//! The operator console (`inbox-web`) mounted under `/ops` of an example's own HTTP
//! server, when `INBOX_WEB_ADDR` is set: the way a service mounts it.
//!
//! The examples have no auth layer of their own, so the console asks for the token of
//! `INBOX_WEB_TOKEN` on its login form (token mode); on a loopback address the token
//! may be left out. A service with its own authentication nests
//! `Console::new(..).router()` behind it instead, and sets
//! [`Console::identity_header`](inbox_web::Console::identity_header) to the header
//! its auth layer fills.

use std::net::SocketAddr;

use inbox_diesel::operator::{Operator, OperatorConnection, ReplayTarget};
use inbox_web::Console;

/// The address the console listens on (`host:port`); unset, no console.
pub const WEB_ADDR_ENV: &str = "INBOX_WEB_ADDR";
/// The console's access token (required off loopback).
pub const WEB_TOKEN_ENV: &str = "INBOX_WEB_TOKEN";
/// Where the examples mount it.
pub const MOUNT: &str = "/ops";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Serves the console under [`MOUNT`] on `INBOX_WEB_ADDR`, on a thread and runtime of
/// its own, and prints `<program>: console on http://<address>/ops`; does nothing when
/// the variable is unset. `prefix` is the topology's (replays go to its queues).
pub fn spawn_from_env<C: OperatorConnection>(
    program: &str,
    operator: Operator<C>,
    prefix: &str,
) -> Result<Option<SocketAddr>, BoxError> {
    let Ok(addr) = std::env::var(WEB_ADDR_ENV) else {
        return Ok(None);
    };
    let addr: SocketAddr = addr
        .trim()
        .parse()
        .map_err(|e| format!("{WEB_ADDR_ENV}={addr:?}: not an address: {e}"))?;
    let mut console = Console::new(operator).replay_target(ReplayTarget::with_prefix(prefix));
    if let Ok(token) = std::env::var(WEB_TOKEN_ENV) {
        console = console.token(token);
    }
    console.check_listen(addr)?;
    let app = axum::Router::new().nest(MOUNT, console.router());
    let std_listener = std::net::TcpListener::bind(addr)
        .map_err(|e| format!("{WEB_ADDR_ENV}={addr}: cannot listen: {e}"))?;
    std_listener.set_nonblocking(true)?;
    let local = std_listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("console".to_owned())
        .spawn(move || {
            runtime.block_on(async move {
                let served = match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(listener) => axum::serve(listener, app).await,
                    Err(e) => Err(e),
                };
                if let Err(err) = served {
                    tracing::error!(error = %err, "the console's listener failed");
                }
            });
        })?;
    println!("{program}: console on http://{local}{MOUNT}");
    Ok(Some(local))
}
