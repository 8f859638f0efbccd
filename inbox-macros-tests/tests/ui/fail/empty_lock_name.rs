use inbox_core::{HandlerError, MessageContext};

#[derive(serde::Deserialize)]
struct Ping {}

struct Conn;

#[derive(inbox_core::Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn, lock = "")]
struct Pings;

impl Pings {
    fn handle(&self, _: &mut Conn, _: Ping, _: &MessageContext<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[derive(inbox_core::Handler)]
#[inbox(group = "pongs", message = Ping, message_type = "pong", connection = Conn,
        lock = serialized(""))]
struct Pongs;

impl Pongs {
    fn handle(&self, _: &mut Conn, _: Ping, _: &MessageContext<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn main() {}
