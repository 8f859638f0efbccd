//! An order service on the facade crate `inbox-outbox` alone: a producer that writes an
//! order and its `order.placed` message in one transaction (the outbox), a consumer
//! whose derived handler keeps a per-customer total (exactly once), a relay in the
//! same process, a rebuild hook that recomputes the totals from the orders, and the
//! operator commands mounted. See `examples/order_service/README.md`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use inbox_outbox::cli::projections::{run_projections, ProjectionCommand};
use inbox_outbox::cli::{service, GlobalArgs};
use inbox_outbox::core_types::rebuild::{HookError, ProjectionRow, Rebuild, SourceEvent};
// `diesel` in scope for diesel's derives (a crate with no diesel dependency of its own).
use inbox_outbox::diesel::{
    self, connection::SimpleConnection, prelude::*, sql_query, sql_types::*, PgConnection,
};
use inbox_outbox::prelude::*;

#[derive(serde::Serialize, serde::Deserialize)]
struct OrderPlaced {
    order_id: i64,
    customer: String,
    cents: i64,
}

/// One batch at a time (its per-event upserts of shared rows would deadlock side by
/// side), and a rebuild waits for it: they never double count.
#[derive(Handler)]
#[inbox(group = "shop.customer-totals", message = OrderPlaced, message_type = "order.placed",
        connection = [PgConnection], lock = serialized("customer_totals"))]
struct CustomerTotals;

impl CustomerTotals {
    fn handle(
        &self,
        c: &mut PgConnection,
        o: OrderPlaced,
        _: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        // An order that would pass its customer's credit limit is refused for good:
        // dead-lettered at once, replayable once the limit is raised.
        let over = sql_query("SELECT l.cents FROM credit_limits l LEFT JOIN customer_totals t USING (customer) WHERE l.customer = $1 AND COALESCE(t.cents, 0) + $2 > l.cents")
            .bind::<Text, _>(&o.customer).bind::<BigInt, _>(o.cents).get_result::<Limit>(c).optional()?;
        if let Some(Limit { cents }) = over {
            let why = format!(
                "order {} would take {} past the credit limit of {cents} cents",
                o.order_id, o.customer
            );
            return Err(HandlerError::permanent(why));
        }
        add(c, &o.customer, o.cents)?;
        Ok(())
    }
}

#[derive(QueryableByName)]
struct Limit {
    #[diesel(sql_type = BigInt)]
    cents: i64,
}

fn add(conn: &mut PgConnection, customer: &str, cents: i64) -> QueryResult<usize> {
    sql_query("INSERT INTO customer_totals VALUES ($1, $2) ON CONFLICT (customer) DO UPDATE SET cents = customer_totals.cents + $2")
        .bind::<Text, _>(customer).bind::<BigInt, _>(cents).execute(conn)
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

#[derive(QueryableByName)]
struct Order {
    #[diesel(sql_type = BigInt)]
    id: i64,
    /// The order's identity on the wire (see [`order_key`]).
    #[diesel(sql_type = Text)]
    order_ref: String,
    #[diesel(embed)]
    total: Total,
}

/// One all-time partition, recomputed from the `orders` table.
impl Rebuild<PgConnection> for CustomerTotals {
    type Partition = &'static str;
    type Source = Total;
    type Row = Total;
    fn projection(&self) -> &str {
        "customer_totals"
    }
    fn window(
        &self,
        _: inbox_outbox::chrono::DateTime<inbox_outbox::chrono::Utc>,
        _: u32,
    ) -> Vec<&'static str> {
        vec!["all"]
    }
    fn read_source(
        &self,
        c: &mut PgConnection,
        _: &&str,
    ) -> Result<Vec<SourceEvent<Total>>, HookError> {
        let orders =
            sql_query("SELECT id, order_ref, customer, cents FROM orders").load::<Order>(c)?;
        Ok(orders
            .into_iter()
            .map(|o| (order_key(&o.order_ref), o.total))
            .collect())
    }
    fn recompute(&self, _: &&str, source: &[SourceEvent<Total>]) -> Vec<Total> {
        let mut sums = std::collections::BTreeMap::<&str, i64>::new();
        for (_, t) in source {
            *sums.entry(&t.customer).or_default() += t.cents;
        }
        let total = |(customer, cents): (&str, i64)| Total {
            customer: customer.into(),
            cents,
        };
        sums.into_iter().map(total).collect()
    }
    fn read_projection(&self, c: &mut PgConnection, _: &&str) -> Result<Vec<Total>, HookError> {
        Ok(sql_query("SELECT customer, cents FROM customer_totals").load(c)?)
    }
    fn replace(&self, c: &mut PgConnection, _: &&str, rows: &[Total]) -> Result<(), HookError> {
        sql_query("DELETE FROM customer_totals").execute(c)?;
        for t in rows {
            add(c, &t.customer, t.cents)?;
        }
        Ok(())
    }
}

/// The message key of an order, from its `order_ref`: what the order row says, so the
/// rebuild finds the key its producer gave. Not from `id`: a sequence can hand an id
/// out again after a failover that lost the order (the row and the sequence roll
/// back together), and the new order's message would then be dropped as the lost
/// one's duplicate. `order_ref` is random for a new order (the id, as text, for an
/// order placed before the column existed: its key stays what it was).
fn order_key(order_ref: &str) -> MessageKey {
    MessageKey::derive("shop", &format!("order:{order_ref}"), "order.placed")
}

/// Creates the service's tables (a setup step: after the framework's migrations,
/// under their lock); an `orders` table from before `order_ref` gets the column, each
/// existing order's set to its id (the key its message already has).
fn tables(c: &mut PgConnection) -> QueryResult<()> {
    c.batch_execute(TABLES)
}

const TABLES: &str = "
    CREATE TABLE IF NOT EXISTS orders (id BIGSERIAL PRIMARY KEY,
        order_ref TEXT NOT NULL UNIQUE DEFAULT gen_random_uuid()::text,
        customer TEXT NOT NULL, cents BIGINT NOT NULL);
    DO $$ BEGIN
        IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema()
                       AND table_name = 'orders' AND column_name = 'order_ref') THEN
            ALTER TABLE orders ADD COLUMN order_ref TEXT UNIQUE;
            UPDATE orders SET order_ref = id::text;
            ALTER TABLE orders ALTER COLUMN order_ref SET DEFAULT gen_random_uuid()::text,
                ALTER COLUMN order_ref SET NOT NULL;
        END IF;
    END $$;
    CREATE TABLE IF NOT EXISTS customer_totals (customer TEXT PRIMARY KEY, cents BIGINT NOT NULL);
    CREATE TABLE IF NOT EXISTS credit_limits (customer TEXT PRIMARY KEY, cents BIGINT NOT NULL)";

#[derive(Parser)]
#[command(name = "order_service", about = "An order service on inbox-outbox")]
struct Cli {
    #[command(flatten)]
    inbox: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Place an order: the order row and its message commit together.
    Place { customer: String, cents: i64 },
    /// Set a customer's credit limit: orders past it are dead-lettered.
    Limit { customer: String, cents: i64 },
    /// Consume and relay until ctrl-c or SIGTERM.
    Run,
    #[command(flatten)]
    Projections(ProjectionCommand),
    #[command(flatten)]
    Ops(inbox_outbox::cli::Command),
}

fn run(cli: Cli) -> Result<ExitCode, Box<dyn std::error::Error + Send + Sync>> {
    match &cli.command {
        Command::Ops(ops) => return Ok(inbox_outbox::cli::run(&cli.inbox, ops)),
        Command::Projections(cmd) => {
            return Ok(run_projections(&cli.inbox, cmd, |b| {
                b.projection(CustomerTotals).setup(tables)
            }))
        }
        _ => {}
    }
    let store = cli
        .inbox
        .store_builder::<PgConnection>()?
        .projection(CustomerTotals)
        .setup(tables)
        .build()?;
    let topology = cli.inbox.topology("shop")?;
    match cli.command {
        Command::Place { customer, cents } => store.connection()?.transaction(|c| {
            let o: Order =
                sql_query("INSERT INTO orders (customer, cents) VALUES ($1, $2) RETURNING *")
                    .bind::<Text, _>(customer)
                    .bind::<BigInt, _>(cents)
                    .get_result(c)?;
            let (id, key, Total { customer, cents }) = (o.id, order_key(&o.order_ref), o.total);
            let body = serde_json::to_vec(&OrderPlaced {
                order_id: id,
                customer,
                cents,
            })?;
            enqueue(
                c,
                &topology.message(key, "order.placed", body),
                store.clock().now(),
            )?;
            println!("order {id} placed");
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        })?,
        Command::Limit { customer, cents } => {
            sql_query("INSERT INTO credit_limits VALUES ($1, $2) ON CONFLICT (customer) DO UPDATE SET cents = $2")
                .bind::<Text, _>(&customer).bind::<BigInt, _>(cents).execute(&mut store.connection()?)?;
            println!("credit limit of {customer}: {cents} cents");
        }
        _ => {
            inbox_examples::scrape::spawn_from_env("order_service")?; // INBOX_METRICS_ADDR
            let operator = inbox_outbox::store::operator::Operator::new(&store); // INBOX_WEB_ADDR: /ops
            inbox_examples::console::spawn_from_env("order_service", operator, &cli.inbox.prefix)?;
            service::serve(&service::amqp_url(), store, topology)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let _process = service::init(); // first: the stack lapin needs, and the logs
    run(Cli::parse()).unwrap_or_else(|err| {
        eprintln!("order_service: {err}");
        ExitCode::FAILURE
    })
}
