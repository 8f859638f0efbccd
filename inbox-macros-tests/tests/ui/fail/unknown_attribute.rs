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
    queue = "pings",
    backoff(start = "1s", max = "1m"),
    retry::policy = Self::policy,
)]
struct Pings;

fn main() {}
