use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn, max_attempts = 0)]
struct Never;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn, max_attempts = 5000000000)]
struct Overflow;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn, max_attempts = "8")]
struct NotANumber;

fn main() {}
