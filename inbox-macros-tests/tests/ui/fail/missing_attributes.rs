use inbox_core::Handler;

#[derive(serde::Deserialize)]
struct Ping;

#[derive(Handler)]
#[inbox(group = "pings")]
struct Partial;

#[derive(Handler)]
struct Bare;

fn main() {}
