//! Generic handler structs: a type parameter for state, and one for the message.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use inbox_core::Clock as _;
use inbox_core::{
    ConsumerGroup, Envelope, Handler, HandlerError, MessageContext, MessageKey, RetryPolicy,
    SystemClock,
};
use serde::de::DeserializeOwned;

#[derive(serde::Deserialize)]
struct Add {
    n: i64,
}

struct Conn;

trait Tally {
    fn add(&self, n: i64);
}

impl Tally for Arc<AtomicI64> {
    fn add(&self, n: i64) {
        self.fetch_add(n, Ordering::SeqCst);
    }
}

/// Generic over where it counts; the bound sits on the struct.
#[derive(Handler)]
#[inbox(group = "generic.tally", message = Add, message_type = "add", connection = [Conn])]
#[inbox(max_attempts = 2)]
struct Counter<T: Tally> {
    tally: T,
}

impl<T: Tally> Counter<T> {
    fn handle(&self, _: &mut Conn, msg: Add, _: &MessageContext<'_>) -> Result<(), HandlerError> {
        self.tally.add(msg.n);
        Ok(())
    }
}

/// Generic over its message, on any connection type.
#[derive(Handler)]
#[inbox(group = "generic.relay", message = M, message_type = "relayed", connection = impl Sized)]
struct Relay<M: DeserializeOwned> {
    relayed: AtomicI64,
    _message: PhantomData<fn() -> M>,
}

impl<M: DeserializeOwned> Relay<M> {
    fn handle<C>(&self, _: &mut C, _: M, _: &MessageContext<'_>) -> Result<(), HandlerError> {
        self.relayed.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn is_handler<C, H: Handler<C>>(_: &H) {}

fn main() {
    let total = Arc::new(AtomicI64::new(0));
    let counter = Counter {
        tally: Arc::clone(&total),
    };
    is_handler::<Conn, _>(&counter);
    assert_eq!(Handler::<Conn>::group(&counter).as_str(), "generic.tally");
    assert_eq!(
        Handler::<Conn>::retry_policy(&counter),
        RetryPolicy::new(
            2,
            RetryPolicy::default().initial(),
            RetryPolicy::default().max()
        )
        .unwrap()
    );

    let envelope = Envelope::new(
        MessageKey::derive("t", "1", "add"),
        "add",
        b"{\"n\":5}".to_vec(),
    );
    let group = ConsumerGroup::new("generic.tally").unwrap();
    let ctx = MessageContext::new(&envelope, &group, 1, SystemClock.now());
    Handler::<Conn>::handle(&counter, &mut Conn, Add { n: 5 }, &ctx).unwrap();
    assert_eq!(total.load(Ordering::SeqCst), 5);

    let relay: Relay<Add> = Relay {
        relayed: AtomicI64::new(0),
        _message: PhantomData,
    };
    is_handler::<Conn, _>(&relay);
    is_handler::<String, _>(&relay);
    assert_eq!(Handler::<Conn>::group(&relay).as_str(), "generic.relay");
    assert_eq!(Handler::<String>::message_type(&relay), "relayed");
    let msg = Handler::<Conn>::decode(&relay, &envelope.payload).unwrap();
    Handler::<Conn>::handle(&relay, &mut Conn, msg, &ctx).unwrap();
    assert_eq!(relay.relayed.load(Ordering::SeqCst), 1);
}
