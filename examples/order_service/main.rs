//! An order service on the facade crate `inbox-outbox` alone: a producer that writes an
//! order and its `order.placed` message in one transaction (the outbox), a consumer
//! whose derived handler keeps a per-customer total (exactly once), a relay in the
//! same process, a rebuild hook that recomputes the totals from the orders, and the
//! operator commands mounted. See `examples/order_service/README.md`.

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use inbox_outbox::core_types::rebuild::{HookError, ProjectionRow, Rebuild, SourceEvent};
use inbox_outbox::core_types::ProjectionLock;
use inbox_outbox::diesel::connection::SimpleConnection;
use inbox_outbox::diesel::{prelude::*, sql_query, sql_types::*, PgConnection};
use inbox_outbox::prelude::*;
use inbox_outbox::store::rebuild::Rebuilder;

#[derive(serde::Serialize, serde::Deserialize)]
struct OrderPlaced {
    order_id: i64,
    customer: String,
    cents: i64,
}

#[derive(Handler)]
#[inbox(group = "shop.customer-totals", message = OrderPlaced,
        message_type = "order.placed", connection = [PgConnection], lock = Self::lock)]
struct CustomerTotals;

impl CustomerTotals {
    /// Live batches take it shared, a rebuild exclusive: they never double count.
    fn lock(&self) -> ProjectionLock {
        ProjectionLock::named("customer_totals")
    }

    fn handle(
        &self,
        conn: &mut PgConnection,
        o: OrderPlaced,
        _: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        sql_query(
            "INSERT INTO customer_totals VALUES ($1, $2) ON CONFLICT (customer) \
                   DO UPDATE SET cents = customer_totals.cents + excluded.cents",
        )
        .bind::<Text, _>(o.customer)
        .bind::<BigInt, _>(o.cents)
        .execute(conn)?;
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, QueryableByName)]
struct Total {
    #[diesel(sql_type = Text)]
    customer: String,
    #[diesel(sql_type = BigInt)]
    cents: i64,
}

impl ProjectionRow for Total {
    fn row_key(&self) -> String {
        self.customer.clone()
    }
    fn measure(&self) -> f64 {
        self.cents as f64
    }
}

/// Customer totals are one all-time partition, recomputed from the `orders` table.
impl Rebuild<PgConnection> for CustomerTotals {
    type Partition = &'static str;
    type Source = Total;
    type Row = Total;
    fn projection(&self) -> &str {
        "customer_totals"
    }
    fn window(&self, _: chrono::DateTime<chrono::Utc>, _: u32) -> Vec<&'static str> {
        vec!["all"]
    }
    fn read_source(
        &self,
        conn: &mut PgConnection,
        _: &&'static str,
    ) -> Result<Vec<SourceEvent<Total>>, HookError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = BigInt)]
            id: i64,
            #[diesel(sql_type = Text)]
            customer: String,
            #[diesel(sql_type = BigInt)]
            cents: i64,
        }
        let rows: Vec<Row> = sql_query("SELECT id, customer, cents FROM orders").load(conn)?;
        Ok(rows
            .into_iter()
            .map(|r| {
                (
                    order_key(r.id),
                    Total {
                        customer: r.customer,
                        cents: r.cents,
                    },
                )
            })
            .collect())
    }
    fn recompute(&self, _: &&'static str, source: &[SourceEvent<Total>]) -> Vec<Total> {
        let mut sums = std::collections::BTreeMap::<String, i64>::new();
        for (_, t) in source {
            *sums.entry(t.customer.clone()).or_default() += t.cents;
        }
        sums.into_iter()
            .map(|(customer, cents)| Total { customer, cents })
            .collect()
    }
    fn read_projection(
        &self,
        conn: &mut PgConnection,
        _: &&'static str,
    ) -> Result<Vec<Total>, HookError> {
        Ok(
            sql_query("SELECT customer, cents FROM customer_totals ORDER BY customer")
                .load(conn)?,
        )
    }
    fn replace(
        &self,
        conn: &mut PgConnection,
        _: &&'static str,
        rows: &[Total],
    ) -> Result<(), HookError> {
        sql_query("DELETE FROM customer_totals").execute(conn)?;
        for t in rows {
            sql_query("INSERT INTO customer_totals VALUES ($1, $2)")
                .bind::<Text, _>(&t.customer)
                .bind::<BigInt, _>(t.cents)
                .execute(conn)?;
        }
        Ok(())
    }
}

/// The message key of an order: the same for a retried producer transaction.
fn order_key(id: i64) -> MessageKey {
    MessageKey::derive("shop", &format!("order:{id}"), "order.placed")
}

#[derive(Parser)]
#[command(name = "order_service", about = "An order service on inbox-outbox")]
struct Cli {
    #[command(flatten)]
    inbox: inbox_outbox::cli::GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Place an order: the order row and its message commit together.
    Place { customer: String, cents: i64 },
    /// Consume and relay until ctrl-c or SIGTERM.
    Run,
    /// Recompute every customer's total from the orders.
    Rebuild,
    #[command(flatten)]
    Ops(inbox_outbox::cli::Command),
}

/// The broker's names; `INBOX_PREFIX` puts a prefix on all of them (a test's own).
fn topology() -> Result<Topology, inbox_outbox::amqp::Error> {
    Topology::new("shop")?.prefix(std::env::var("INBOX_PREFIX").unwrap_or_default())
}

fn store(url: &str) -> Result<Store<PgConnection>, Box<dyn std::error::Error + Send + Sync>> {
    let store = Store::<PgConnection>::builder(url)
        .projection(CustomerTotals)
        .build()?;
    store.connection()?.batch_execute(
        "CREATE TABLE IF NOT EXISTS orders (id BIGSERIAL PRIMARY KEY, customer TEXT NOT NULL, cents BIGINT NOT NULL);
         CREATE TABLE IF NOT EXISTS customer_totals (customer TEXT PRIMARY KEY, cents BIGINT NOT NULL)")?;
    Ok(store)
}

async fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let db = cli
        .inbox
        .database_url
        .clone()
        .ok_or("set DATABASE_URL (postgres://...)")?;
    let amqp = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let store = tokio::task::spawn_blocking(move || store(&db)).await??;
    match cli.command {
        Command::Place { customer, cents } => {
            tokio::task::spawn_blocking(move || {
                #[derive(QueryableByName)]
                struct Id {
                    #[diesel(sql_type = BigInt)]
                    id: i64,
                }
                store.connection()?.transaction(|conn| {
                    let Id { id } = sql_query(
                        "INSERT INTO orders (customer, cents) VALUES ($1, $2) RETURNING id",
                    )
                    .bind::<Text, _>(&customer)
                    .bind::<BigInt, _>(cents)
                    .get_result(conn)?;
                    let body = serde_json::to_vec(&OrderPlaced {
                        order_id: id,
                        customer,
                        cents,
                    })?;
                    let msg = OutboxMessage::new(
                        order_key(id),
                        topology()?.exchange(),
                        "order.placed",
                        body,
                    );
                    enqueue(conn, &msg, store.clock().now())?;
                    println!("order {id} placed");
                    Ok(())
                })
            })
            .await?
        }
        Command::Run => {
            inbox_examples::scrape::serve_from_env("order_service").await?;
            let shutdown = cancel_on_signals(CancellationToken::new());
            let store = Arc::new(store);
            let consumer = Consumer::new(amqp.clone(), store.clone(), topology()?);
            let relay = Relay::new(amqp, store);
            let (consumed, relayed) =
                tokio::join!(consumer.run(shutdown.clone()), relay.run(shutdown));
            Ok(consumed.and(relayed)?)
        }
        Command::Rebuild => {
            tokio::task::spawn_blocking(move || {
                println!(
                    "{}",
                    serde_json::to_string(&Rebuilder::new(&store, "customer_totals")?.rebuild(1)?)?
                );
                Ok(())
            })
            .await?
        }
        Command::Ops(_) => Err("the operator commands run without the runtime".into()),
    }
}

fn main() -> ExitCode {
    // lapin parses header tables on a thread of its own with the default stack: give
    // every thread the stack its deepest table needs, before any thread starts.
    if std::env::var_os("RUST_MIN_STACK").is_none() {
        std::env::set_var(
            "RUST_MIN_STACK",
            inbox_outbox::amqp::frame_parse_stack().to_string(),
        );
    }
    let cli = Cli::parse();
    let _logging = inbox_examples::init_logging();
    let done = match &cli.command {
        Command::Ops(command) => return inbox_outbox::cli::run(&cli.inbox, command),
        _ => tokio::runtime::Runtime::new()
            .map_err(Into::into)
            .and_then(|rt| rt.block_on(run(cli))),
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("order_service: {err}");
            ExitCode::FAILURE
        }
    }
}
