// Without an inherent `handle`, `Self::handle` would be the trait's own method and
// call itself forever; the derive makes that a compile error.
use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(group = "pings", message = Ping, message_type = "ping", connection = Conn)]
struct Pings;

fn main() {}
