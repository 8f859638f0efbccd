//! `lock = "name"` and `lock = serialized("name")`: the projection lock by its name,
//! no method needed.

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

#[derive(Handler)]
#[inbox(group = "pongs", message = Ping, message_type = "pong", connection = Conn,
        lock = serialized("pong_totals"))]
struct Pongs;

impl Pongs {
    fn handle(&self, _: &mut Conn, _: Ping, _: &MessageContext<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn main() {
    let lock = Handler::<Conn>::lock(&Pongs).unwrap();
    assert_eq!(lock, ProjectionLock::serialized("pong_totals"));
    assert!(lock.is_exclusive());
    assert!(!Handler::<Conn>::lock(&Pings).unwrap().is_exclusive());
    assert_eq!(
        Handler::<Conn>::lock(&Pings),
        Some(ProjectionLock::named("ping_totals"))
    );
    assert_ne!(
        Handler::<Conn>::lock(&Pings),
        Some(ProjectionLock::named("other"))
    );
}
