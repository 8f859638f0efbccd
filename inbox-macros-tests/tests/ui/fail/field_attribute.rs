use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn)]
struct Pings {
    #[inbox(max_attempts = 3)]
    limit: u32,
}

fn main() {}
