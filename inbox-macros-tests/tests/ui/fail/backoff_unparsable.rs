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
    backoff(initial = "1 second", max = "1d"),
)]
struct Words;

#[derive(Handler)]
#[inbox(
    group = "pings",
    message = Ping,
    message_type = "ping",
    connection = Conn,
    backoff(initial = "1.5s", max = "99999999999999999999h"),
)]
struct Fraction;

fn main() {}
