//! `usage.recorded` → `daily_usage(user_id, day, total)`.
//!
//! The message contract: AMQP `type` and routing key `usage.recorded`, `message_id` =
//! message key, JSON body `{"user_id": 42, "day": "2026-11-30", "amount": 40}` with an
//! integer user id (a JSON integer), an ISO date written exactly `YYYY-MM-DD` and a
//! positive integer amount, 1 to 2^63 - 1. Anything else (a float, a string for a
//! number, `2026-11-3`, `2026-11-30T00:00:00Z`, an amount of 0) is refused when the
//! body is decoded: a permanent failure, dead-lettered as `decode_error`. A day's total
//! that would exceed 2^63 - 1 is refused too: the event that would overflow it is
//! dead-lettered (`permanent`), the total is never wrapped.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::NaiveDate;
use diesel::connection::SimpleConnection;
use diesel::pg::Pg;
use diesel::prelude::*;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Date};
use diesel::{PgConnection, SqliteConnection};
use inbox_core::rebuild::{days_ending, HookError, ProjectionRow, Rebuild, SourceEvent};
use inbox_core::{
    Envelope, Handler, HandlerError, MessageContext, MessageKey, ProjectionLock, RetryPolicy,
};
use serde::{Deserialize, Serialize};

/// The consumer group of the projection.
pub const GROUP: &str = "billing.daily-usage";

/// The message type.
pub const MESSAGE_TYPE: &str = "usage.recorded";

/// The projection's name (operators say `usage_ops rebuild daily_usage`).
pub const PROJECTION: &str = "daily_usage";

/// The message key of the event a `usage_ledger` row produced: the one function the
/// producer and the rebuild both derive it with (a rebuild covers exactly the keys
/// the producer gave its events).
pub fn ledger_event_key(ledger_id: i64) -> MessageKey {
    MessageKey::derive(
        "billing",
        &format!("usage_ledger:{ledger_id}"),
        MESSAGE_TYPE,
    )
}

/// A row of `daily_usage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DailyTotal {
    /// The user.
    pub user_id: i64,
    /// The day.
    pub day: NaiveDate,
    /// The sum of the day's amounts.
    pub total: i64,
}

impl ProjectionRow for DailyTotal {
    fn row_key(&self) -> String {
        format!("user {}", self.user_id)
    }

    fn measure(&self) -> f64 {
        self.total as f64
    }
}

/// A row of `usage_ledger`, the projection's source of truth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LedgerRow {
    /// The row's id (its event's key is [`ledger_event_key`] of it).
    pub id: i64,
    /// The user.
    pub user_id: i64,
    /// The amount.
    pub amount: i64,
}

/// One metered usage event.
///
/// Decoding is strict, as the contract says: see [`UsageRecorded::parse_day`] and
/// [`UsageRecorded::check_amount`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawUsage")]
pub struct UsageRecorded {
    /// The user charged.
    pub user_id: i64,
    /// The billing day.
    pub day: NaiveDate,
    /// Units used, positive.
    pub amount: i64,
}

/// The body as JSON has it, before the contract's checks.
#[derive(Deserialize)]
struct RawUsage {
    user_id: i64,
    day: String,
    amount: i64,
}

/// A body the contract refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ContractError {
    /// The day is not a calendar date written `YYYY-MM-DD`.
    #[error("day must be a date written YYYY-MM-DD, found {found:?}")]
    Day {
        /// What the body held.
        found: String,
    },
    /// The amount is not positive.
    #[error("amount must be 1 to 9223372036854775807, found {found}")]
    Amount {
        /// What the body held.
        found: i64,
    },
}

impl TryFrom<RawUsage> for UsageRecorded {
    type Error = ContractError;

    fn try_from(raw: RawUsage) -> Result<Self, ContractError> {
        Ok(Self {
            user_id: raw.user_id,
            day: Self::parse_day(&raw.day)?,
            amount: Self::check_amount(raw.amount)?,
        })
    }
}

impl UsageRecorded {
    /// The event's envelope under `key` (the body as the contract writes it).
    pub fn envelope(&self, key: MessageKey) -> Envelope {
        let payload = serde_json::to_vec(self).unwrap_or_default();
        Envelope::new(key, MESSAGE_TYPE, payload)
    }

    /// A day as the contract writes it: exactly `YYYY-MM-DD` (four-digit year, two-digit
    /// month and day, no sign, time or spaces), and a real calendar date.
    pub fn parse_day(text: &str) -> Result<NaiveDate, ContractError> {
        let refused = || ContractError::Day {
            found: text.to_owned(),
        };
        let shape = text.len() == 10
            && text.bytes().enumerate().all(|(i, b)| match i {
                4 | 7 => b == b'-',
                _ => b.is_ascii_digit(),
            });
        if !shape {
            return Err(refused());
        }
        NaiveDate::parse_from_str(text, "%Y-%m-%d").map_err(|_| refused())
    }

    /// An amount as the contract allows it: positive.
    pub fn check_amount(amount: i64) -> Result<i64, ContractError> {
        if amount > 0 {
            Ok(amount)
        } else {
            Err(ContractError::Amount { found: amount })
        }
    }
}

/// The projection's table, on the two backends the example runs on.
pub trait UsageDb: Connection + Send + 'static {
    /// Creates `daily_usage` if missing.
    fn create_daily_usage(&mut self) -> QueryResult<()>;

    /// Creates `usage_ledger` if missing.
    fn create_usage_ledger(&mut self) -> QueryResult<()>;

    /// Writes a ledger row; returns its id.
    fn insert_ledger(&mut self, user_id: i64, day: NaiveDate, amount: i64) -> QueryResult<i64>;

    /// Every ledger row of a day, in one statement.
    fn ledger_of_day(&mut self, day: NaiveDate) -> QueryResult<Vec<LedgerRow>>;

    /// Every `daily_usage` row of a day.
    fn totals_of_day(&mut self, day: NaiveDate) -> QueryResult<Vec<DailyTotal>>;

    /// Deletes a day's `daily_usage` rows and writes `rows` (of that day) instead.
    fn replace_day(&mut self, day: NaiveDate, rows: &[DailyTotal]) -> QueryResult<()>;

    /// Adds `amount` to the row of (`user_id`, `day`).
    fn add_usage(&mut self, user_id: i64, day: NaiveDate, amount: i64) -> QueryResult<()>;

    /// Adds many (user, day, amount) sums, in the order given (sort them, so that
    /// concurrent batches lock rows in one order).
    fn add_usage_rows(&mut self, rows: &[(i64, NaiveDate, i64)]) -> QueryResult<()>;

    /// Every row.
    fn daily_totals(&mut self) -> QueryResult<BTreeMap<(i64, NaiveDate), i64>>;
}

#[derive(QueryableByName)]
struct LedgerRecord {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = BigInt)]
    amount: i64,
}

#[derive(QueryableByName)]
struct TotalRow {
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = Date)]
    day: NaiveDate,
    #[diesel(sql_type = BigInt)]
    total: i64,
}

/// The same statements on both backends; only the table's column types differ.
macro_rules! usage_db {
    ($conn:ty, $create:literal, $ledger:literal, $add_rows:path) => {
        impl UsageDb for $conn {
            fn create_usage_ledger(&mut self) -> QueryResult<()> {
                self.batch_execute($ledger)
            }

            fn insert_ledger(
                &mut self,
                user_id: i64,
                day: NaiveDate,
                amount: i64,
            ) -> QueryResult<i64> {
                #[derive(QueryableByName)]
                struct Id {
                    #[diesel(sql_type = BigInt)]
                    id: i64,
                }
                diesel::sql_query(
                    "INSERT INTO usage_ledger (user_id, day, amount) VALUES ($1, $2, $3) RETURNING id",
                )
                .bind::<BigInt, _>(user_id)
                .bind::<Date, _>(day)
                .bind::<BigInt, _>(amount)
                .get_result::<Id>(self)
                .map(|r| r.id)
            }

            fn ledger_of_day(&mut self, day: NaiveDate) -> QueryResult<Vec<LedgerRow>> {
                let rows: Vec<LedgerRecord> =
                    diesel::sql_query("SELECT id, user_id, amount FROM usage_ledger WHERE day = $1")
                        .bind::<Date, _>(day)
                        .load(self)?;
                Ok(rows
                    .into_iter()
                    .map(|r| LedgerRow {
                        id: r.id,
                        user_id: r.user_id,
                        amount: r.amount,
                    })
                    .collect())
            }

            fn totals_of_day(&mut self, day: NaiveDate) -> QueryResult<Vec<DailyTotal>> {
                let rows: Vec<TotalRow> = diesel::sql_query(
                    "SELECT user_id, day, total FROM daily_usage WHERE day = $1",
                )
                .bind::<Date, _>(day)
                .load(self)?;
                Ok(rows
                    .into_iter()
                    .map(|r| DailyTotal {
                        user_id: r.user_id,
                        day: r.day,
                        total: r.total,
                    })
                    .collect())
            }

            fn replace_day(&mut self, day: NaiveDate, rows: &[DailyTotal]) -> QueryResult<()> {
                diesel::sql_query("DELETE FROM daily_usage WHERE day = $1")
                    .bind::<Date, _>(day)
                    .execute(self)?;
                let mut rows: Vec<(i64, NaiveDate, i64)> = rows
                    .iter()
                    .filter(|r| r.day == day)
                    .map(|r| (r.user_id, r.day, r.total))
                    .collect();
                rows.sort_unstable();
                self.add_usage_rows(&rows)
            }

            fn add_usage_rows(&mut self, rows: &[(i64, NaiveDate, i64)]) -> QueryResult<()> {
                $add_rows(self, rows)
            }

            fn create_daily_usage(&mut self) -> QueryResult<()> {
                self.batch_execute($create)
            }

            fn add_usage(&mut self, user_id: i64, day: NaiveDate, amount: i64) -> QueryResult<()> {
                diesel::sql_query(
                    "INSERT INTO daily_usage (user_id, day, total) VALUES ($1, $2, $3) \
                     ON CONFLICT (user_id, day) DO UPDATE SET total = daily_usage.total + excluded.total",
                )
                .bind::<BigInt, _>(user_id)
                .bind::<Date, _>(day)
                .bind::<BigInt, _>(amount)
                .execute(self)
                .map(|_| ())
            }

            fn daily_totals(&mut self) -> QueryResult<BTreeMap<(i64, NaiveDate), i64>> {
                let rows: Vec<TotalRow> =
                    diesel::sql_query("SELECT user_id, day, total FROM daily_usage").load(self)?;
                Ok(rows.into_iter().map(|r| ((r.user_id, r.day), r.total)).collect())
            }
        }
    };
}

/// The example's tables (the projection and the ledger), for
/// [`StoreBuilder::setup`](inbox_diesel::StoreBuilder::setup): run under the framework's
/// migration lock, so a consumer and a producer that start at once on a fresh database
/// both start.
pub fn create_usage_tables<C: UsageDb>(conn: &mut C) -> QueryResult<()> {
    conn.create_daily_usage()?;
    conn.create_usage_ledger()
}

usage_db!(
    PgConnection,
    "CREATE TABLE IF NOT EXISTS daily_usage (user_id BIGINT NOT NULL, day DATE NOT NULL, \
     total BIGINT NOT NULL, PRIMARY KEY (user_id, day))",
    "CREATE TABLE IF NOT EXISTS usage_ledger (id BIGSERIAL PRIMARY KEY, \
     user_id BIGINT NOT NULL, day DATE NOT NULL, amount BIGINT NOT NULL)",
    pg_add_rows
);
// SQLite's `+` turns an integer overflow into a REAL without an error; the CHECK
// refuses the REAL, so a total that would overflow fails its statement (a constraint
// error, permanent) as PostgreSQL's `bigint out of range` does.
usage_db!(
    SqliteConnection,
    "CREATE TABLE IF NOT EXISTS daily_usage (user_id INTEGER NOT NULL, day TEXT NOT NULL, \
     total INTEGER NOT NULL CHECK (typeof(total) = 'integer'), PRIMARY KEY (user_id, day))",
    "CREATE TABLE IF NOT EXISTS usage_ledger (id INTEGER PRIMARY KEY, \
     user_id INTEGER NOT NULL, day TEXT NOT NULL, amount INTEGER NOT NULL)",
    sqlite_add_rows
);

/// One multi-row upsert: a single round trip whatever the batch size.
fn pg_add_rows(conn: &mut PgConnection, rows: &[(i64, NaiveDate, i64)]) -> QueryResult<()> {
    AddRows {
        users: rows.iter().map(|r| r.0).collect(),
        days: rows.iter().map(|r| r.1).collect(),
        amounts: rows.iter().map(|r| r.2).collect(),
    }
    .execute(conn)
    .map(|_| ())
}

/// The upsert of [`pg_add_rows`] as a query fragment rather than `sql_query`: diesel
/// prepares a statement once per connection only when it can tell the text never
/// changes, which neither raw SQL nor a `do_update()` upsert promises. Written this way (diesel
/// numbers the binds) the server parses and plans it once, not for every batch.
struct AddRows {
    users: Vec<i64>,
    days: Vec<NaiveDate>,
    amounts: Vec<i64>,
}

impl QueryId for AddRows {
    type QueryId = Self;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl RunQueryDsl<PgConnection> for AddRows {}

impl QueryFragment<Pg> for AddRows {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO daily_usage (user_id, day, total) SELECT * FROM unnest(");
        out.push_bind_param::<Array<BigInt>, _>(&self.users)?;
        out.push_sql("::bigint[], ");
        out.push_bind_param::<Array<Date>, _>(&self.days)?;
        out.push_sql("::date[], ");
        out.push_bind_param::<Array<BigInt>, _>(&self.amounts)?;
        out.push_sql(
            "::bigint[]) ON CONFLICT (user_id, day) \
             DO UPDATE SET total = daily_usage.total + excluded.total",
        );
        Ok(())
    }
}

/// SQLite runs in-process: a statement per row costs no round trip.
fn sqlite_add_rows(conn: &mut SqliteConnection, rows: &[(i64, NaiveDate, i64)]) -> QueryResult<()> {
    for (user_id, day, amount) in rows {
        conn.add_usage(*user_id, *day, *amount)?;
    }
    Ok(())
}

/// The projection handler: adds each event's amount to its day's total.
///
/// It folds: a batch's events are summed per (user, day) and written once per row.
/// User 0 does not exist: its events fail, are retried and end dead-lettered (the
/// quickstart's poison). The same handler serves PostgreSQL and SQLite: the derive
/// implements `Handler<C>` for every connection `C: UsageDb`.
#[derive(Handler)]
#[inbox(
    group = "billing.daily-usage",
    message = UsageRecorded,
    message_type = "usage.recorded",
    connection = impl UsageDb,
    retry_policy = Self::policy,
    fold = Self::add_batch,
    lock = Self::projection_lock,
)]
pub struct DailyUsage {
    policy: RetryPolicy,
}

impl DailyUsage {
    /// The handler with a retry policy.
    pub fn new(policy: RetryPolicy) -> Self {
        Self { policy }
    }

    fn policy(&self) -> RetryPolicy {
        self.policy
    }

    /// One event, when a batch did not fold (it isolates the poison).
    fn handle<C: UsageDb>(
        &self,
        conn: &mut C,
        msg: UsageRecorded,
        _ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        check(&msg)?;
        conn.add_usage(msg.user_id, msg.day, msg.amount)?;
        Ok(())
    }

    /// A whole batch: the sums per (user, day), in one multi-row upsert.
    fn add_batch<C: UsageDb>(
        &self,
        conn: &mut C,
        batch: &[(UsageRecorded, MessageContext<'_>)],
    ) -> Result<(), HandlerError> {
        let mut sums: BTreeMap<(i64, NaiveDate), i64> = BTreeMap::new();
        for (msg, _) in batch {
            check(msg)?;
            let sum = sums.entry((msg.user_id, msg.day)).or_default();
            // An overflow fails the fold; the store then runs one event at a time, and
            // the event that overflows the stored total fails alone (the database
            // refuses that total: `bigint out of range`, SQLite's CHECK).
            *sum = sum.checked_add(msg.amount).ok_or_else(|| {
                HandlerError::permanent(format!(
                    "the total of user {} on {} overflows: {} + {}",
                    msg.user_id, msg.day, sum, msg.amount
                ))
            })?;
        }
        // Sorted by (user, day): concurrent batches lock the rows in one order.
        let rows: Vec<(i64, NaiveDate, i64)> = sums
            .into_iter()
            .map(|((user_id, day), amount)| (user_id, day, amount))
            .collect();
        conn.add_usage_rows(&rows)?;
        Ok(())
    }

    /// Live handlers take it shared before they claim; a rebuild takes it exclusive.
    fn projection_lock(&self) -> ProjectionLock {
        ProjectionLock::named("daily_usage")
    }
}

/// The projection's rebuild hooks: `daily_usage` recomputed from `usage_ledger`, a
/// day per partition. The window is today (UTC) and the days before it.
impl<C: UsageDb> Rebuild<C> for DailyUsage {
    type Partition = NaiveDate;
    type Source = (i64, i64);
    type Row = DailyTotal;

    fn projection(&self) -> &str {
        PROJECTION
    }

    fn window(&self, now: chrono::DateTime<chrono::Utc>, size: u32) -> Vec<NaiveDate> {
        days_ending(now, size)
    }

    fn read_source(
        &self,
        conn: &mut C,
        day: &NaiveDate,
    ) -> Result<Vec<SourceEvent<(i64, i64)>>, HookError> {
        Ok(conn
            .ledger_of_day(*day)?
            .into_iter()
            .map(|r| (ledger_event_key(r.id), (r.user_id, r.amount)))
            .collect())
    }

    fn recompute(&self, day: &NaiveDate, source: &[SourceEvent<(i64, i64)>]) -> Vec<DailyTotal> {
        let mut sums: BTreeMap<i64, i64> = BTreeMap::new();
        for (_, (user_id, amount)) in source {
            // The live path refuses a total past 2^63 - 1; so does the rebuild (the
            // total stops there rather than wrap).
            let sum = sums.entry(*user_id).or_default();
            *sum = sum.saturating_add(*amount);
        }
        sums.into_iter()
            .map(|(user_id, total)| DailyTotal {
                user_id,
                day: *day,
                total,
            })
            .collect()
    }

    fn read_projection(&self, conn: &mut C, day: &NaiveDate) -> Result<Vec<DailyTotal>, HookError> {
        Ok(conn.totals_of_day(*day)?)
    }

    fn replace(&self, conn: &mut C, day: &NaiveDate, rows: &[DailyTotal]) -> Result<(), HookError> {
        Ok(conn.replace_day(*day, rows)?)
    }
}

/// What the contract leaves to the handler (decoding checked the rest).
fn check(msg: &UsageRecorded) -> Result<(), HandlerError> {
    if msg.user_id == 0 {
        return Err(HandlerError::transient("user 0 does not exist"));
    }
    Ok(())
}

/// A deterministic generator (xorshift), so runs are reproducible without a `rand`.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    /// The next number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// A workload: events, with `poison` of them for user 0.
pub struct Workload {
    /// (key, event) of every distinct event.
    pub events: Vec<(MessageKey, UsageRecorded)>,
}

impl Workload {
    /// `count` events over 20 users and 3 days; the first `poison` belong to user 0.
    pub fn generate(count: usize, poison: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let first_day = NaiveDate::from_ymd_opt(2026, 11, 28).unwrap_or_default();
        let events = (0..count)
            .map(|i| {
                let key =
                    MessageKey::derive("billing", &format!("usage-event-{seed}-{i}"), MESSAGE_TYPE);
                let event = UsageRecorded {
                    user_id: if i < poison {
                        0
                    } else {
                        1 + rng.below(20) as i64
                    },
                    day: first_day + chrono::Days::new(rng.below(3)),
                    amount: 1 + rng.below(100) as i64,
                };
                (key, event)
            })
            .collect();
        Self { events }
    }

    /// The envelope of event `i`.
    pub fn envelope(&self, i: usize) -> Envelope {
        let (key, event) = &self.events[i];
        let payload = serde_json::to_vec(event).unwrap_or_default();
        Envelope::new(key.clone(), MESSAGE_TYPE, payload)
    }

    /// The totals the projection must hold: every distinct event applied once, poison
    /// (user 0) never.
    pub fn expected_totals(&self) -> BTreeMap<(i64, NaiveDate), i64> {
        let mut totals = BTreeMap::new();
        for (_, e) in self.events.iter().filter(|(_, e)| e.user_id != 0) {
            *totals.entry((e.user_id, e.day)).or_default() += e.amount;
        }
        totals
    }
}

/// The retry policy of the quickstart: 4 attempts, a few milliseconds apart.
pub fn quick_policy() -> RetryPolicy {
    RetryPolicy::new(4, Duration::from_millis(2), Duration::from_millis(10))
        .unwrap_or_else(|_| unreachable!("valid literal policy"))
}

/// Compares the projection with the expected totals; lists every difference.
pub fn diff_totals(
    expected: &BTreeMap<(i64, NaiveDate), i64>,
    found: &BTreeMap<(i64, NaiveDate), i64>,
) -> Vec<String> {
    let mut diffs = Vec::new();
    for (key, want) in expected {
        match found.get(key) {
            Some(got) if got == want => {}
            got => diffs.push(format!(
                "user {} on {}: expected {want}, found {got:?}",
                key.0, key.1
            )),
        }
    }
    for key in found.keys().filter(|k| !expected.contains_key(*k)) {
        diffs.push(format!("user {} on {}: unexpected row", key.0, key.1));
    }
    diffs
}
