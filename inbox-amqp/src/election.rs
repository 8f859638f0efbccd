//! A quorum queue without a leader: what a cluster node answers while the queue's
//! replicas elect one (after its leader's node died or restarted), and why it is
//! waited for rather than fatal.
//!
//! RabbitMQ (3.x, quorum queues) answers an operation that needs the queue's leader
//! while there is none with a connection-level `541 INTERNAL_ERROR`, whose text
//! names the quorum queue: `timed out consuming from quorum queue 'q' in vhost '/'`
//! for a `basic.consume`, `Cannot declare a queue 'q' on node '...'` for a declaration
//! that must start the queue's replicas. Neither says anything about the
//! configuration: once a majority of the queue's replicas is back and has elected a
//! leader (seconds after a node's loss), the same operation succeeds.
//!
//! So a declaration answered so is not the startup failure a misconfiguration is:
//! the supervisor waits it out with the reconnect backoff (jittered, growing up to
//! `backoff_max`) and tries again, moving to the next broker URL, for as long as it
//! takes. A consume answered so ends the session as a lost connection does, which
//! was already reconnected after backoff. Any other `INTERNAL_ERROR` stays what it
//! was.

use crate::Error;

/// Whether `err` is a broker's answer that a quorum queue has no leader yet.
pub(crate) fn awaits_election(err: &Error) -> bool {
    match err {
        Error::Amqp(err) => leaderless_text(&err.to_string()),
        _ => false,
    }
}

/// Whether a broker's error text says a quorum queue has no leader yet: an
/// `INTERNAL_ERROR` naming a quorum queue, or a queue that could not be declared
/// on a node.
fn leaderless_text(text: &str) -> bool {
    let internal = text.contains("INTERNAL_ERROR") || text.contains("INTERNAL-ERROR");
    internal
        && (text.contains("quorum queue")
            || text.contains("Cannot declare a queue")
            || text.contains("no leader"))
}

/// A lapin error as the broker sends one (for tests).
#[cfg(test)]
pub(crate) fn internal_error(text: &str) -> Error {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPHardError};
    let kind = AMQPErrorKind::Hard(AMQPHardError::INTERNALERROR);
    let err = AMQPError::new(kind, text.into());
    Error::Amqp(lapin::Error::from(lapin::ErrorKind::ProtocolError(err)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leaderless_quorum_queue_is_told_from_other_errors() {
        for text in [
            "INTERNAL_ERROR - timed out consuming from quorum queue 'q' in vhost '/': {'%2F_q','rabbit@n1'}",
            "INTERNAL_ERROR - Cannot declare a queue 'queue 'q' in vhost '/'' on node 'rabbit@n2': {error,timeout}",
        ] {
            let err = internal_error(text);
            assert!(awaits_election(&err), "{err}");
        }
        for err in [
            internal_error("INTERNAL_ERROR - something else broke"),
            Error::TopologyConflict {
                name: "q".to_owned(),
                detail: "PRECONDITION_FAILED - inequivalent arg, quorum queue".to_owned(),
            },
        ] {
            assert!(!awaits_election(&err), "{err}");
        }
    }
}
