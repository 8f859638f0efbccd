use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "", connection = Conn)]
struct Pings;

fn main() {}
