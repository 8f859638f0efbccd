//! A quorum queue without a leader: what a cluster node answers while the queue's
//! replicas elect one (after its leader's node died or restarted), and why it is
//! waited for rather than fatal.
//!
//! RabbitMQ (3.x, quorum queues) answers an operation that needs the queue's leader
//! while there is none with a connection-level `541 INTERNAL_ERROR`. Its text may
//! name the quorum queue (`timed out consuming from quorum queue 'q' in vhost '/'`
//! for a `basic.consume`, `Cannot declare a queue 'q' on node '...'` for a
//! declaration that must start the queue's replicas), or be the bare
//! `INTERNAL_ERROR` of a channel process that crashed waiting for the leader: a
//! consume from a quorum queue whose majority is lost, on RabbitMQ 3.10, answers
//! just that (`rabbit_cluster::a_queue_without_a_leader_is_waited_for_until_an_election_gives_it_one`).
//! None of them says anything about the configuration, and no `541` does: it is
//! the server's own failure (a misconfiguration is `403`, `404`, `406` or `530`).
//! Once a majority of the queue's replicas is back and has elected a leader, the
//! same operation succeeds.
//!
//! So a declaration answered with `541` is not the startup failure a
//! misconfiguration is: the supervisor waits it out with the reconnect backoff
//! (jittered, growing up to `backoff_max`) and tries again, moving to the next
//! broker URL, for as long as it takes, logging each answer at `warn`. A consume
//! answered so ends the session as a lost connection does, which was already
//! reconnected after backoff.

use crate::Error;

/// Whether `err` is a broker's answer that a quorum queue has no leader yet: an
/// `INTERNAL_ERROR` (`541`), told by its code, never by its text (which can hold
/// names a client chose).
pub(crate) fn awaits_election(err: &Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError};
    match err {
        Error::Amqp(err) => match err.kind() {
            lapin::ErrorKind::ProtocolError(answer) => matches!(
                answer.kind(),
                AMQPErrorKind::Hard(AMQPHardError::INTERNALERROR)
            ),
            _ => false,
        },
        _ => false,
    }
}

/// Runs `declare` until it is answered otherwise than as a queue without a leader
/// answers, pausing with the jittered reconnect backoff (from `min`, doubling to
/// `max`) between tries; `Ok` at once when `shutdown` is cancelled.
pub(crate) async fn declare_once_led<F, Fut>(
    shutdown: &tokio_util::sync::CancellationToken,
    (min, max): (std::time::Duration, std::time::Duration),
    mut declare: F,
) -> crate::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = crate::Result<()>>,
{
    let mut backoff = min;
    loop {
        let declared = tokio::select! {
            declared = declare() => declared,
            () = shutdown.cancelled() => return Ok(()),
        };
        match declared {
            Err(err) if awaits_election(&err) => {
                tracing::warn!(error = %inbox_core::ErrorChain(&err), ?backoff, "a quorum queue has no leader yet (an election); waiting");
                crate::connect::pause(shutdown, &mut backoff, max).await;
            }
            declared => return declared,
        }
    }
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
    fn a_declaration_is_tried_again_while_the_queue_has_no_leader_and_no_longer() {
        let runtime = crate::test_support::runtime();
        let pauses = (
            std::time::Duration::from_millis(1),
            std::time::Duration::from_millis(5),
        );
        let shutdown = tokio_util::sync::CancellationToken::new();
        // Two leaderless answers, then the answer that stands.
        for (last, ends) in [(Ok(()), true), (Err("NOT_ALLOWED"), false)] {
            let tries = std::cell::Cell::new(0);
            let declared = runtime.block_on(declare_once_led(&shutdown, pauses, || {
                tries.set(tries.get() + 1);
                let n = tries.get();
                async move {
                    match (n, last) {
                        (1 | 2, _) => Err(internal_error("INTERNAL_ERROR")),
                        (_, Ok(())) => Ok(()),
                        (_, Err(_)) => Err(Error::invalid("url", "a vhost", "v")),
                    }
                }
            }));
            assert_eq!(declared.is_ok(), ends, "{declared:?}");
            assert_eq!(tries.get(), 3, "tried until the answer was not a 541");
        }
        // A shutdown ends the wait.
        shutdown.cancel();
        let declared = runtime.block_on(declare_once_led(&shutdown, pauses, || async {
            Err(internal_error("INTERNAL_ERROR"))
        }));
        assert!(declared.is_ok(), "{declared:?}");
    }

    #[test]
    fn a_leaderless_quorum_queue_is_told_from_other_errors() {
        for text in [
            "INTERNAL_ERROR - timed out consuming from quorum queue 'q' in vhost '/': {'%2F_q','rabbit@n1'}",
            "INTERNAL_ERROR - Cannot declare a queue 'queue 'q' in vhost '/'' on node 'rabbit@n2': {error,timeout}",
            // What RabbitMQ 3.10 answered a consume of a queue whose majority was lost.
            "INTERNAL_ERROR",
        ] {
            let err = internal_error(text);
            assert!(awaits_election(&err), "{err}");
        }
        let answer = |kind, text: &str| {
            let err = lapin::protocol::AMQPError::new(kind, text.into());
            Error::Amqp(lapin::Error::from(lapin::ErrorKind::ProtocolError(err)))
        };
        use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
        for err in [
            answer(
                AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED),
                "NOT_ALLOWED - vhost 'v' not found",
            ),
            // A name chosen by a client is no 541.
            answer(
                AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED),
                "ACCESS_REFUSED - access to queue 'INTERNAL_ERROR' in vhost '/' refused",
            ),
            Error::TopologyConflict {
                name: "q".to_owned(),
                detail: "PRECONDITION_FAILED - inequivalent arg, quorum queue".to_owned(),
            },
        ] {
            assert!(!awaits_election(&err), "{err}");
        }
    }
}
