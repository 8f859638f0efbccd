// `retry_policy = Self::retry_policy` without an inherent `retry_policy` would be the
// trait's own method calling itself; the derive makes that a compile error.
use inbox_core::{Handler, HandlerError, MessageContext};

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(
    group = "pings",
    message = Ping,
    message_type = "ping",
    connection = Conn,
    retry_policy = Self::retry_policy,
)]
struct Pings;

impl Pings {
    fn handle(&self, _: &mut Conn, _: Ping, _: &MessageContext<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn main() {}
