use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn)]
union Pings {
    fast: u32,
    slow: f32,
}

fn main() {}
