// One build reports every mistake of a derive, each at its token.
use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;

#[derive(Handler)]
#[inbox(
    group = "Pings!",
    message = Ping,
    message_type = "ping",
    max_attempts = 0,
    backoff(initial = "soon"),
    prefetch = 10,
)]
enum Pings {}

fn main() {}
