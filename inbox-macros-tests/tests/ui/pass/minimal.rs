//! The smallest handler: group, message, message type, connection, and a `handle`.

use inbox_core::Clock as _;
use inbox_core::{
    ConsumerGroup, Envelope, Handler, HandlerError, MessageContext, MessageKey, RetryPolicy,
    SystemClock,
};

#[derive(serde::Deserialize)]
struct Ping {
    n: u32,
}

/// A stand-in for a store connection.
#[derive(Default)]
struct Conn {
    seen: Vec<u32>,
}

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn)]
struct Pings;

impl Pings {
    fn handle(
        &self,
        conn: &mut Conn,
        msg: Ping,
        _ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        conn.seen.push(msg.n);
        Ok(())
    }
}

fn main() {
    let handler = Pings;
    assert_eq!(Handler::<Conn>::group(&handler).as_str(), "pings");
    assert_eq!(Handler::<Conn>::message_type(&handler), "ping");
    assert_eq!(
        Handler::<Conn>::retry_policy(&handler),
        RetryPolicy::default()
    );
    assert_eq!(Handler::<Conn>::lock(&handler), None);

    let envelope = Envelope::new(
        MessageKey::derive("t", "1", "ping"),
        "ping",
        b"{\"n\":7}".to_vec(),
    );
    let group = ConsumerGroup::new("pings").unwrap();
    let ctx = MessageContext::new(&envelope, &group, 1, SystemClock.now());
    let mut conn = Conn::default();
    let msg = Handler::<Conn>::decode(&handler, &envelope.payload).unwrap();
    assert!(Handler::<Conn>::fold(&handler, &mut conn, &[]).is_none());
    Handler::<Conn>::handle(&handler, &mut conn, msg, &ctx).unwrap();
    assert_eq!(conn.seen, [7]);
}
