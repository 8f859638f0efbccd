use inbox_core::{Handler, HandlerError, MessageContext};

struct Ping; // no serde::Deserialize
struct Conn;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn)]
struct Pings;

impl Pings {
    fn handle(&self, _: &mut Conn, _: Ping, _: &MessageContext<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn main() {}
