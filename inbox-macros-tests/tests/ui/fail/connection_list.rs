use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = [])]
struct NoConnection;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = [Conn, Conn])]
struct Twice;

fn main() {}
