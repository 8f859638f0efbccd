//! Which dead letters a replay may send again.

use inbox_core::DeadLetterReason;

/// Whether a dead letter whose stored reason is `reason` can be replayed as it is, and
/// if not, what an operator does instead: [`DeadLetterReason::replay_refusal`] for the
/// reasons this version knows, a refusal for any other text.
///
/// Replayable (the claim is reset and the same message goes to its group again, once
/// the cause is fixed): `max_attempts`, `permanent`, `crash_loop`, `delivery_limit`,
/// and `no_handler` (once a handler of the group takes the type; replayed before that,
/// it is dead-lettered again as `no_handler`).
///
/// Never replayed:
/// - `key_collision`: the letter's payload is another message than the one its key's
///   claim belongs to; sent again, it could only collide again (or, worse, take a
///   claim that is not its own). Fix the producer's key derivation, publish the message
///   under its own key, then discard the letter.
/// - `malformed`: the delivery could not be read as an envelope (no key, too large, a
///   type or tenant the store cannot hold); it has no claim to reset. Fix the producer
///   and publish a corrected message, then discard the letter.
/// - `decode_error`: the payload does not decode into the handler's message type, and
///   the same bytes would fail the same way. Publish a corrected message under a new
///   key (or deploy a handler that reads this form and then replay is still refused:
///   the letter's bytes are kept for inspection), then discard the letter.
///
/// Any reason this version does not know is refused too.
///
/// ```
/// use inbox_diesel::operator::replay_refusal;
/// assert_eq!(replay_refusal("max_attempts"), None);
/// assert_eq!(replay_refusal("no_handler"), None);
/// assert!(replay_refusal("key_collision").unwrap().contains("own key"));
/// ```
pub fn replay_refusal(reason: &str) -> Option<&'static str> {
    match DeadLetterReason::parse(reason) {
        Some(known) => known.replay_refusal(),
        None => Some("unknown reason: not replayed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_classified() {
        use DeadLetterReason as R;
        for (reason, replayable) in [
            (R::MaxAttempts, true),
            (R::Permanent, true),
            (R::CrashLoop, true),
            (R::DeliveryLimit, true),
            (R::NoHandler, true),
            (R::KeyCollision, false),
            (R::Malformed, false),
            (R::DecodeError, false),
        ] {
            assert_eq!(
                replay_refusal(reason.as_str()).is_none(),
                replayable,
                "{reason}"
            );
        }
        assert!(replay_refusal("something_new").is_some());
    }
}
