//! A body the transport cut (over its `max_body_bytes`): the letter keeps the prefix,
//! the whole body's length and SHA-256, on both backends, and shows them to the
//! operator. The two columns are written once, by the insert that creates the letter;
//! no writer updates them, so no race meets on them.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use inbox_core::{
    payload_digest, DeadLetterOutcome, DeadLetterReason, Envelope, InboxStore, MessageKey,
    PayloadCut, CUT_PAYLOAD_PREFIX,
};
use inbox_diesel::operator::Operator;
use inbox_test_support::{group, Fixture};

const GROUP: &str = "billing.daily-usage";

inbox_test_support::on_both_backends!(
    a_cut_payload_keeps_its_prefix_length_and_digest,
    a_half_recorded_cut_is_an_unreadable_letter,
);

/// What the AMQP transport hands the store for a body over its limit.
fn cut_envelope(body: &[u8]) -> Envelope {
    let (prefix, cut) = PayloadCut::of(body);
    let key = MessageKey::derive("inbox.malformed", "cut", "usage.recorded");
    let mut env = Envelope::new(key, "usage.recorded", prefix);
    env.payload_cut = Some(cut);
    env
}

fn a_cut_payload_keeps_its_prefix_length_and_digest<F: Fixture>(fx: &F) {
    let store = fx.builder().build().unwrap();
    let g = group(GROUP);
    let body: Vec<u8> = (0..3 * CUT_PAYLOAD_PREFIX as u32)
        .map(|i| i as u8)
        .collect();
    let outcome = store
        .dead_letter(
            &g,
            &cut_envelope(&body),
            DeadLetterReason::Malformed,
            "body of 12288 bytes exceeds the limit of 8192 bytes",
        )
        .unwrap();
    assert_eq!(outcome, DeadLetterOutcome::Recorded);
    // A letter stored whole records no cut.
    let whole = Envelope::new(MessageKey::new("whole").unwrap(), "usage.recorded", vec![1]);
    store
        .dead_letter(&g, &whole, DeadLetterReason::Malformed, "no message_id")
        .unwrap();

    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(dead.len(), 2);
    assert_eq!(dead[0].payload, body[..CUT_PAYLOAD_PREFIX]);
    let expected = PayloadCut {
        length: body.len() as u64,
        sha256: payload_digest(&body),
    };
    assert_eq!(dead[0].payload_cut, Some(expected));
    assert_eq!(
        (dead[1].payload.clone(), dead[1].payload_cut),
        (vec![1], None)
    );

    let details = Operator::new(&store)
        .dead_letter_details(dead[0].id)
        .unwrap()
        .unwrap();
    assert_eq!(details.payload, body[..CUT_PAYLOAD_PREFIX]);
    assert_eq!(details.payload_cut, Some(expected));
    assert!(
        details.replay_refusal.is_some(),
        "a cut letter is not replayable"
    );
    let details = Operator::new(&store)
        .dead_letter_details(dead[1].id)
        .unwrap()
        .unwrap();
    assert_eq!(details.payload_cut, None);
}

fn a_half_recorded_cut_is_an_unreadable_letter<F: Fixture>(fx: &F) {
    let store = fx.builder().build().unwrap();
    let g = group(GROUP);
    store
        .dead_letter(
            &g,
            &cut_envelope(&[7; 2 * CUT_PAYLOAD_PREFIX]),
            DeadLetterReason::Malformed,
            "too large",
        )
        .unwrap();
    let unreadable = |problem: &str| {
        let text = match store.dead_letters(&g) {
            Err(err) => inbox_core::ErrorChain(&err).to_string(),
            Ok(read) => panic!("{problem}: read as {:?}", read[0].payload_cut),
        };
        assert!(text.contains(problem), "{text}");
        let text = match Operator::new(&store).dead_letter_details(1) {
            Err(err) => inbox_core::ErrorChain(&err).to_string(),
            Ok(read) => panic!("{problem}: read as {:?}", read.map(|d| d.payload_cut)),
        };
        assert!(text.contains(problem), "{text}");
    };
    fx.execute("UPDATE inbox_dead_letters SET payload_sha256 = NULL");
    unreadable("are not both set or both null");
    fx.execute("UPDATE inbox_dead_letters SET payload_sha256 = payload, payload_length = 8192");
    unreadable("payload_sha256 has 4096 bytes, expected 32");
    fx.execute("UPDATE inbox_dead_letters SET payload_length = NULL, payload_sha256 = NULL");
    assert_eq!(store.dead_letters(&g).unwrap()[0].payload_cut, None);
}
