//! Opt-in (`--features testcontainers`): without `DATABASE_URL` / `AMQP_URL`, start
//! PostgreSQL and RabbitMQ in containers of a local Docker engine, once per test
//! process. CI never uses this path: it runs the services directly.

use std::sync::OnceLock;

use testcontainers_modules::postgres::Postgres;
use testcontainers_modules::rabbitmq::RabbitMq;
use testcontainers_modules::testcontainers::runners::SyncRunner;
use testcontainers_modules::testcontainers::{Container, ImageExt};

/// A started container and the URL that reaches it; the container lives as long as
/// the test process.
struct Started<I: testcontainers_modules::testcontainers::Image> {
    _container: Container<I>,
    url: String,
}

static POSTGRES: OnceLock<Result<Started<Postgres>, String>> = OnceLock::new();
static RABBITMQ: OnceLock<Result<Started<RabbitMq>, String>> = OnceLock::new();

/// A PostgreSQL container's URL, or why none could be started.
pub fn postgres() -> Result<String, String> {
    POSTGRES
        .get_or_init(|| {
            let container = Postgres::default()
                .start()
                .map_err(|e| format!("could not start a PostgreSQL container: {e}"))?;
            let port = container
                .get_host_port_ipv4(5432)
                .map_err(|e| format!("PostgreSQL container has no port: {e}"))?;
            Ok(Started {
                url: format!("postgres://postgres:postgres@127.0.0.1:{port}/postgres"),
                _container: container,
            })
        })
        .as_ref()
        .map(|s| s.url.clone())
        .map_err(Clone::clone)
}

/// A RabbitMQ container's URL (3.10: quorum retry tiers need at-least-once
/// dead-lettering), or why none could be started.
pub fn rabbitmq() -> Result<String, String> {
    RABBITMQ
        .get_or_init(|| {
            let container = RabbitMq::default()
                .with_tag("3.10-management")
                .start()
                .map_err(|e| format!("could not start a RabbitMQ container: {e}"))?;
            let port = container
                .get_host_port_ipv4(5672)
                .map_err(|e| format!("RabbitMQ container has no port: {e}"))?;
            Ok(Started {
                url: format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
                _container: container,
            })
        })
        .as_ref()
        .map(|s| s.url.clone())
        .map_err(Clone::clone)
}
