use inbox_core::{Handler, RetryPolicy};

#[derive(serde::Deserialize)]
struct Ping;
struct Conn;

#[derive(Handler)]
#[inbox(
    group = "pings",
    message = Ping,
    message_type = "ping",
    connection = Conn,
    max_attempts = 3,
    backoff(initial = "1s"),
    retry_policy = Self::policy,
)]
struct Pings;

impl Pings {
    fn policy(&self) -> RetryPolicy {
        RetryPolicy::default()
    }
}

fn main() {}
