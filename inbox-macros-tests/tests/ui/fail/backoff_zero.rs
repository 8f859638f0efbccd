use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(
    group = "pings",
    message = Ping,
    message_type = "ping",
    connection = Conn,
    backoff(initial = "0ms", max = "1s"),
)]
struct Immediate;

fn main() {}
