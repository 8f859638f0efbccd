//! The order service example (`examples/order_service`), run as its README says: three
//! orders placed, the consumer and relay in one process, the totals exact, a damaged
//! projection healed by `rebuild`, `/metrics` served, and the mounted operator commands
//! answering. It runs with `RUST_MIN_STACK` unset, as a user who sets nothing.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use inbox_amqp::Topology;
use inbox_core::ConsumerGroup;
use inbox_test_support::metrics::scrape;

#[derive(QueryableByName, Debug, PartialEq)]
struct Total {
    #[diesel(sql_type = Text)]
    customer: String,
    #[diesel(sql_type = BigInt)]
    cents: i64,
}

struct Scene {
    base: String,
    url: String,
    amqp: String,
    schema: String,
    prefix: String,
}

impl Scene {
    fn new() -> Option<Self> {
        let base = inbox_test_support::postgres_url()?;
        let amqp = inbox_test_support::amqp::amqp_url()?;
        let schema = inbox_test_support::unique_name("orders");
        PgConnection::establish(&base)
            .unwrap()
            .batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
            .unwrap();
        let url = inbox_test_support::search_path_url(&base, &schema);
        let prefix = format!("{schema}.");
        Some(Self {
            base,
            url,
            amqp,
            schema,
            prefix,
        })
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(inbox_test_support::example_path("order_service"));
        cmd.args(args)
            .env("DATABASE_URL", &self.url)
            .env("AMQP_URL", &self.amqp)
            .env("INBOX_PREFIX", &self.prefix)
            .stdin(Stdio::null());
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        let out = self.command(args).output().unwrap();
        assert!(
            out.status.success(),
            "order_service {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn totals(&self) -> Vec<Total> {
        let mut conn = PgConnection::establish(&self.url).unwrap();
        diesel::sql_query("SELECT customer, cents FROM customer_totals ORDER BY customer")
            .load(&mut conn)
            .unwrap()
    }
}

impl Drop for Scene {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.base) {
            let _ = conn.batch_execute(&format!(
                "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                self.schema
            ));
        }
        let topology = Topology::new("shop")
            .and_then(|t| t.prefix(self.prefix.clone()))
            .map(|t| {
                t.group(
                    ConsumerGroup::new("shop.customer-totals").unwrap(),
                    ["order.placed"],
                )
            });
        if let (Ok(topology), Ok(rt)) = (topology, tokio::runtime::Runtime::new()) {
            let amqp = self.amqp.clone();
            rt.block_on(async move {
                if let Ok(conn) =
                    lapin::Connection::connect(&amqp, lapin::ConnectionProperties::default()).await
                {
                    let _ = topology.delete(&conn).await;
                    let _ = conn.close(200, "test over".into()).await;
                }
            });
        }
    }
}

fn t(customer: &str, cents: i64) -> Total {
    Total {
        customer: customer.to_owned(),
        cents,
    }
}

#[test]
fn orders_are_totalled_once_healed_by_a_rebuild_and_seen_by_the_operator_commands() {
    let Some(scene) = Scene::new() else { return };
    for (customer, cents) in [("ada", "1250"), ("bob", "300"), ("ada", "50")] {
        scene.run(&["place", customer, cents]);
    }
    let mut service = scene
        .command(&["run"])
        .env("INBOX_METRICS_ADDR", "127.0.0.1:0")
        .env_remove("RUST_MIN_STACK")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its log, read as it comes (a full pipe would stall the service).
    let stderr = BufReader::new(service.stderr.take().unwrap());
    let log = std::thread::spawn(move || stderr.lines().map_while(Result::ok).collect::<Vec<_>>());
    let mut stdout = BufReader::new(service.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("order_service: metrics on http://")
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("the first line names the metrics address: {line:?}"))
        .to_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    while scene.totals() != [t("ada", 1300), t("bob", 300)] {
        assert!(
            Instant::now() < deadline,
            "totals after 60 s: {:?}",
            scene.totals()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let metrics = scrape(&addr);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("inbox_processed_total{") && l.ends_with(" 3")),
        "three orders processed: {metrics}"
    );
    assert!(Command::new("kill")
        .args(["-TERM", &service.id().to_string()])
        .status()
        .unwrap()
        .success());
    let status = service.wait().unwrap();
    let log = log.join().unwrap();
    assert!(
        log.iter()
            .any(|l| l.contains("topology declared; consuming and relaying")),
        "the service says what it consumes: {log:#?}"
    );
    assert!(
        !log.iter().any(|l| l.contains("RUST_MIN_STACK")),
        "service::init gave lapin's thread its stack: {log:#?}"
    );
    assert!(
        !log.iter().any(|l| l.contains("ERROR")),
        "a clean run and shutdown log no error: {log:#?}"
    );
    assert!(
        status.success(),
        "the service stops cleanly on SIGTERM: {status}"
    );

    let mut conn = PgConnection::establish(&scene.url).unwrap();
    conn.batch_execute("UPDATE customer_totals SET cents = 1")
        .unwrap();
    let audit = scene.run(&["--json", "audit", "customer_totals"]);
    let audit: serde_json::Value = serde_json::from_slice(&audit.stdout).unwrap();
    assert_eq!(audit["rows_differing"], 2, "{audit}");
    assert_eq!(
        scene.totals(),
        [t("ada", 1), t("bob", 1)],
        "an audit writes nothing"
    );
    let report = scene.run(&["--json", "rebuild", "customer_totals"]);
    let report: serde_json::Value = serde_json::from_slice(&report.stdout).unwrap();
    assert_eq!(report["events_covered"], 3, "{report}");
    assert_eq!(report["rows_changed"], 2, "{report}");
    assert_eq!(scene.totals(), [t("ada", 1300), t("bob", 300)]);

    let stats = scene.run(&["--json", "stats"]);
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert!(
        stats.to_string().contains("shop.customer-totals"),
        "{stats}"
    );
    let letters = scene.run(&["dead-letters", "list"]);
    assert!(String::from_utf8_lossy(&letters.stdout).contains("0 dead letters"));
}

/// The keys of the outbox's rows, in id order.
fn outbox_keys(conn: &mut PgConnection) -> Vec<String> {
    #[derive(QueryableByName)]
    struct Key {
        #[diesel(sql_type = Text)]
        message_key: String,
    }
    diesel::sql_query("SELECT message_key FROM outbox_messages ORDER BY id")
        .load::<Key>(conn)
        .unwrap()
        .into_iter()
        .map(|k| k.message_key)
        .collect()
}

/// A failover that loses committed transactions rolls the `orders` rows back with
/// the sequence that numbered them, so a new order can get a lost order's id. Its
/// message must not get the lost one's key: that message may have reached the broker
/// and a consumer already, and the new order would be dropped as its duplicate. The
/// rollback is done by hand (the rows and the outbox row deleted, the sequence
/// restarted), as the promoted standby has it.
#[test]
fn an_order_id_handed_out_again_after_a_failover_gets_a_new_message_key() {
    let Some(scene) = Scene::new() else { return };
    let placed = scene.run(&["place", "ada", "1250"]);
    assert_eq!(String::from_utf8_lossy(&placed.stdout), "order 1 placed\n");
    let mut conn = PgConnection::establish(&scene.url).unwrap();
    let lost = outbox_keys(&mut conn);
    assert_eq!(lost.len(), 1);
    conn.batch_execute(
        "DELETE FROM outbox_messages; DELETE FROM orders; ALTER SEQUENCE orders_id_seq RESTART",
    )
    .unwrap();
    let placed = scene.run(&["place", "bob", "300"]);
    assert_eq!(
        String::from_utf8_lossy(&placed.stdout),
        "order 1 placed\n",
        "the id came round again"
    );
    let new = outbox_keys(&mut conn);
    assert_eq!(new.len(), 1);
    assert_ne!(new, lost, "the new order 1 has a key of its own");
}

/// An `orders` table from before `order_ref` is upgraded in place: each existing
/// order keeps the key its message already has (derived from its id), so a rebuild
/// records the claims its live deliveries carry; a new order's key is random.
#[test]
fn orders_placed_before_order_ref_keep_their_keys() {
    let Some(scene) = Scene::new() else { return };
    let mut conn = PgConnection::establish(&scene.url).unwrap();
    conn.batch_execute(
        "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, customer TEXT NOT NULL, cents BIGINT NOT NULL);
         INSERT INTO orders (customer, cents) VALUES ('ada', 1250), ('bob', 300)",
    )
    .unwrap();
    let placed = scene.run(&["place", "ada", "50"]);
    assert_eq!(String::from_utf8_lossy(&placed.stdout), "order 3 placed\n");
    let old_key = |id: u32| {
        inbox_core::MessageKey::derive("shop", &format!("order:{id}"), "order.placed")
            .as_str()
            .to_owned()
    };
    let new = outbox_keys(&mut conn);
    assert_eq!(new.len(), 1);
    assert_ne!(new[0], old_key(3), "a new order's key is not its id's");

    let report = scene.run(&["--json", "rebuild", "customer_totals"]);
    let report: serde_json::Value = serde_json::from_slice(&report.stdout).unwrap();
    assert_eq!(report["events_covered"], 3, "{report}");
    assert_eq!(scene.totals(), [t("ada", 1300), t("bob", 300)]);
    #[derive(QueryableByName)]
    struct Claim {
        #[diesel(sql_type = Text)]
        message_key: String,
    }
    let mut claimed: Vec<String> = diesel::sql_query(
        "SELECT message_key FROM inbox_claims WHERE consumer_group = 'shop.customer-totals'",
    )
    .load::<Claim>(&mut conn)
    .unwrap()
    .into_iter()
    .map(|c| c.message_key)
    .collect();
    claimed.sort();
    let mut expected = vec![old_key(1), old_key(2), new[0].clone()];
    expected.sort();
    assert_eq!(
        claimed, expected,
        "the rebuild covered each order under its message's key"
    );
}
