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
    backoff(initial = "10m", max = "5m"),
)]
struct Both;

// The max not given is the default, 5m.
#[derive(Handler)]
#[inbox(
    group = "pings",
    message = Ping,
    message_type = "ping",
    connection = Conn,
    backoff(initial = "1h"),
)]
struct DefaultMax;

// The initial not given is the default, 1s.
#[derive(Handler)]
#[inbox(
    group = "pings",
    message = Ping,
    message_type = "ping",
    connection = Conn,
    backoff(max = "500ms"),
)]
struct DefaultInitial;

fn main() {}
