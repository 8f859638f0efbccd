use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(group = "", message = Ping, message_type = "ping", connection = Conn)]
struct Empty;

// 101 bytes: one over the limit.
#[derive(Handler)]
#[inbox(
    group = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    message = Ping,
    message_type = "ping",
    connection = Conn,
)]
struct TooLong;

fn main() {}
