use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

// `:` names a group's retry tiers and dead-letter queue, so groups may not use it.
#[derive(Handler)]
#[inbox(group = "billing:retry", message = Ping, message_type = "ping", connection = Conn)]
struct Colon;

#[derive(Handler)]
#[inbox(group = "Billing.Daily", message = Ping, message_type = "ping", connection = Conn)]
struct Uppercase;

fn main() {}
