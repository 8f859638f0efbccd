//! A handler with state (a pool, a clock, a config), generic over its connection, with
//! its retry policy taken from its configuration at run time.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_core::{
    Clock, ConsumerGroup, Envelope, Handler, HandlerError, HandlerErrorKind, ManualClock,
    MessageContext, MessageKey, RetryPolicy, SystemClock,
};

#[derive(serde::Deserialize)]
struct Shipped {
    order: u64,
}

/// What the handler writes through the store's connection.
trait Orders {
    fn mark_shipped(&mut self, order: u64, at_unix: i64);
}

#[derive(Default)]
struct Conn {
    shipped: Vec<(u64, i64)>,
}

impl Orders for Conn {
    fn mark_shipped(&mut self, order: u64, at_unix: i64) {
        self.shipped.push((order, at_unix));
    }
}

struct Config {
    attempts: u32,
    refuse_order: u64,
}

#[derive(Handler)]
#[inbox(
    group = "shipping.orders",
    message = Shipped,
    message_type = "order.shipped",
    connection = impl Orders + Send,
    retry_policy = Self::policy,
)]
struct MarkShipped {
    notifications: Arc<Mutex<Vec<u64>>>,
    clock: Arc<dyn Clock>,
    config: Config,
}

impl MarkShipped {
    fn handle<C: Orders>(
        &self,
        conn: &mut C,
        msg: Shipped,
        _ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        if msg.order == self.config.refuse_order {
            return Err(HandlerError::permanent(format!(
                "order {} is refused",
                msg.order
            )));
        }
        conn.mark_shipped(msg.order, self.clock.now().timestamp());
        self.notifications.lock().unwrap().push(msg.order);
        Ok(())
    }

    fn policy(&self) -> RetryPolicy {
        RetryPolicy::new(
            self.config.attempts,
            Duration::from_millis(5),
            Duration::from_secs(1),
        )
        .unwrap_or_default()
    }
}

fn main() {
    let clock = ManualClock::new(SystemClock.now());
    let at = clock.now();
    let handler = MarkShipped {
        notifications: Arc::default(),
        clock: Arc::new(clock),
        config: Config {
            attempts: 5,
            refuse_order: 13,
        },
    };
    assert_eq!(Handler::<Conn>::retry_policy(&handler).max_attempts(), 5);
    assert_eq!(Handler::<Conn>::group(&handler).as_str(), "shipping.orders");

    let envelope = Envelope::new(
        MessageKey::derive("t", "1", "order.shipped"),
        "order.shipped",
        Vec::new(),
    );
    let group = ConsumerGroup::new("shipping.orders").unwrap();
    let ctx = MessageContext::new(&envelope, &group, 1, at);
    let mut conn = Conn::default();
    Handler::<Conn>::handle(&handler, &mut conn, Shipped { order: 7 }, &ctx).unwrap();
    assert_eq!(conn.shipped, [(7, at.timestamp())]);
    assert_eq!(*handler.notifications.lock().unwrap(), [7]);
    let err =
        Handler::<Conn>::handle(&handler, &mut conn, Shipped { order: 13 }, &ctx).unwrap_err();
    assert_eq!(err.kind(), HandlerErrorKind::Permanent);
}
