//! `lock = "name"`: the projection lock by its name, no method needed.

use inbox_core::{Handler, HandlerError, MessageContext, ProjectionLock};

#[derive(serde::Deserialize)]
struct Ping {}

struct Conn;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn,
        lock = "ping_totals")]
struct Pings;

impl Pings {
    fn handle(&self, _: &mut Conn, _: Ping, _: &MessageContext<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn main() {
    assert_eq!(
        Handler::<Conn>::lock(&Pings),
        Some(ProjectionLock::named("ping_totals"))
    );
    assert_ne!(
        Handler::<Conn>::lock(&Pings),
        Some(ProjectionLock::named("other"))
    );
}
