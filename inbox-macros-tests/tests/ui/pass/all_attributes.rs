//! Every attribute, split over two `#[inbox]` attributes, on two connection types.

use std::time::Duration;

use inbox_core::Clock as _;
use inbox_core::{
    ConsumerGroup, DynHandler, Envelope, Handler, HandlerError, HandlerErrorKind, MessageContext,
    MessageKey, ProjectionLock, RetryPolicy, SystemClock,
};

#[derive(serde::Deserialize)]
struct Charge {
    account: u32,
    cents: i64,
}

/// Two stand-ins for store connections.
#[derive(Default)]
struct Primary {
    writes: Vec<(u32, i64)>,
}
#[derive(Default)]
struct Replica {
    writes: Vec<(u32, i64)>,
}

trait Ledger {
    fn write(&mut self, account: u32, cents: i64);
}
impl Ledger for Primary {
    fn write(&mut self, account: u32, cents: i64) {
        self.writes.push((account, cents));
    }
}
impl Ledger for Replica {
    fn write(&mut self, account: u32, cents: i64) {
        self.writes.push((account, cents));
    }
}

#[derive(Handler)]
#[inbox(
    group = "billing.charges_v2",
    message = Charge,
    message_type = "charge.created",
    connection = [Primary, Replica],
)]
#[inbox(
    handle = Self::apply,
    fold = Self::fold,
    lock = Self::lock,
    max_attempts = 3,
    backoff(initial = "250ms", max = "1h"),
)]
struct Charges;

#[derive(Debug)]
struct Refused;
impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("refused")
    }
}
impl std::error::Error for Refused {}

impl Charges {
    // Any error type converts (as transient), like `?` in a hand-written handler.
    fn apply<C: Ledger>(
        &self,
        conn: &mut C,
        msg: Charge,
        _ctx: &MessageContext<'_>,
    ) -> Result<(), Refused> {
        if msg.cents < 0 {
            return Err(Refused);
        }
        conn.write(msg.account, msg.cents);
        Ok(())
    }

    // Named like the trait's methods: the inherent ones are the ones called.
    fn fold<C: Ledger>(
        &self,
        conn: &mut C,
        batch: &[(Charge, MessageContext<'_>)],
    ) -> Result<(), HandlerError> {
        let total = batch.iter().map(|(m, _)| m.cents).sum();
        conn.write(0, total);
        Ok(())
    }

    fn lock(&self) -> ProjectionLock {
        ProjectionLock::named("charges")
    }
}

fn main() {
    let handler = Charges;
    let policy =
        RetryPolicy::new(3, Duration::from_millis(250), Duration::from_secs(3600)).unwrap();
    assert_eq!(Handler::<Primary>::retry_policy(&handler), policy);
    assert_eq!(Handler::<Replica>::retry_policy(&handler), policy);
    assert_eq!(
        Handler::<Primary>::group(&handler).as_str(),
        "billing.charges_v2"
    );
    assert_eq!(
        Handler::<Replica>::group(&handler).as_str(),
        "billing.charges_v2"
    );
    assert_eq!(Handler::<Replica>::message_type(&handler), "charge.created");
    assert_eq!(
        Handler::<Primary>::lock(&handler),
        Some(ProjectionLock::named("charges"))
    );

    let group = ConsumerGroup::new("billing.charges_v2").unwrap();
    let envelope = |n: u32, cents: i64| {
        let body = format!("{{\"account\":{n},\"cents\":{cents}}}");
        let key = MessageKey::derive("t", &n.to_string(), "charge.created");
        Envelope::new(key, "charge.created", body.into_bytes())
    };
    let (a, b) = (envelope(1, 40), envelope(2, 2));
    let now = SystemClock.now();
    let ctxs = [
        MessageContext::new(&a, &group, 1, now),
        MessageContext::new(&b, &group, 1, now),
    ];

    // The type-erased path the store takes: decode, then fold the batch.
    let mut primary = Primary::default();
    DynHandler::<Primary>::handle_all(&handler, &mut primary, &ctxs)
        .map_err(|(_, e)| e.to_string())
        .unwrap();
    assert_eq!(primary.writes, [(0, 42)]);

    // One at a time, on the other connection type.
    let mut replica = Replica::default();
    DynHandler::<Replica>::handle_payload(&handler, &mut replica, &ctxs[0]).unwrap();
    assert_eq!(replica.writes, [(1, 40)]);

    let refused = envelope(3, -1);
    let ctx = MessageContext::new(&refused, &group, 1, now);
    let msg = Handler::<Replica>::decode(&handler, &refused.payload).unwrap();
    let err = Handler::<Replica>::handle(&handler, &mut replica, msg, &ctx).unwrap_err();
    assert_eq!(err.kind(), HandlerErrorKind::Transient);
    assert!(err.downcast_ref::<Refused>().is_some());
}
