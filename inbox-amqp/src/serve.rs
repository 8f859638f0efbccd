//! A consumer and a relay in one process, ended together.
//!
//! A service that consumes and also writes to the outbox runs both: the relay is what
//! publishes the rows the handlers enqueue, and what publishes an operator's replay
//! (a replay is an outbox row). [`serve`] runs them side by side until `shutdown`,
//! and when either ends on an error it stops the other (draining it as a shutdown
//! would) and returns that error: a process never keeps consuming with a dead relay,
//! nor relaying with a dead consumer.
//!
//! Before either starts, it declares the consumer's topology once (on a connection of
//! its own, closed after, with the consumer's connect timeout, name and CA), so the
//! first outbox rows of a fresh deployment addressed to this process's own consumer
//! groups find their queues bound instead of coming back unroutable (rows for another
//! service's groups wait for that service to declare them); a broker that refuses
//! that connection or declaration fails `serve` at once, as it would fail the
//! consumer, but a declaration answered as a queue without a leader answers (`541`,
//! during an election) is tried again after the reconnect backoff, as the
//! consumer's own is; a shutdown during it ends `serve` with `Ok`.

use std::sync::atomic::Ordering;

use inbox_core::{GroupHalts, InboxStore, OutboxStore};
use tokio_util::sync::CancellationToken;

use crate::{Consumer, Relay, Result};

/// Runs `consumer` and `relay` until `shutdown` is cancelled or either fails (see the
/// module docs); the error of the one that failed first.
///
/// ```no_run
/// use std::sync::Arc;
/// use inbox_amqp::{cancel_on_signals, CancellationToken, Consumer, Relay, Topology};
/// # async fn run<S>(store: S) -> Result<(), inbox_amqp::Error>
/// # where S: inbox_core::InboxStore + inbox_core::GroupHalts + inbox_core::OutboxStore {
/// let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// let store = Arc::new(store);
/// let consumer = Consumer::new(url, store.clone(), Topology::new("shop")?);
/// let relay = Relay::new(url, store);
/// inbox_amqp::serve(consumer, relay, cancel_on_signals(CancellationToken::new())).await
/// # }
/// ```
pub async fn serve<S, O>(
    consumer: Consumer<S>,
    relay: Relay<O>,
    shutdown: CancellationToken,
) -> Result<()>
where
    S: InboxStore + GroupHalts,
    O: OutboxStore,
{
    consumer.declare_topology(&shutdown).await?;
    let topology = consumer.topology();
    let queues: Vec<String> = topology.groups().map(|g| topology.queue(g)).collect();
    tracing::info!(
        exchange = %topology.exchange(),
        queues = %queues.join(","),
        "topology declared; consuming and relaying"
    );
    // Cancelled by the caller's token, or by whichever of the two fails first.
    let stop = shutdown.child_token();
    // Which failed first (1 the consumer, 2 the relay): its error is the one returned.
    let first = std::sync::atomic::AtomicU8::new(0);
    let ended = |who: u8, result: Result<()>| {
        if result.is_err() {
            let _ = first.compare_exchange(0, who, Ordering::SeqCst, Ordering::SeqCst);
            stop.cancel();
        }
        result
    };
    let consumed = async { ended(1, consumer.run(stop.clone()).await) };
    let relayed = async { ended(2, relay.run(stop.clone()).await) };
    let (consumed, relayed) = tokio::join!(consumed, relayed);
    match (first.load(Ordering::SeqCst), consumed, relayed) {
        (2, _, Err(err)) => Err(err),
        (_, consumed, relayed) => consumed.and(relayed),
    }
}
