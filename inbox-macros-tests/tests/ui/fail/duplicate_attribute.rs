use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn)]
#[inbox(group = "pongs", backoff(initial = "1s", initial = "2s"))]
struct Pings;

fn main() {}
