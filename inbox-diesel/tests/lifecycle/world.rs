//! The world the lifecycle test runs in: a source table the test owns (`lc_ledger`),
//! a projection fed by the inbox (`lc_totals`, a per-user, per-day sum) with rebuild
//! hooks that recompute it from the ledger, a handler that can be told to fail
//! transiently, permanently or panic per key and attempt, and the raw reads the
//! comparisons need.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel::{PgConnection, SqliteConnection};
use inbox_core::rebuild::{days_ending, HookError, ProjectionRow, Rebuild, SourceEvent};
use inbox_core::{
    ConsumerGroup, Envelope, Handler, HandlerError, MessageContext, MessageKey, ProjectionLock,
    RetryPolicy,
};
use serde::{Deserialize, Serialize};

/// The consumer group of the projection.
pub(crate) const GROUP: &str = "lifecycle.totals";
/// The projection's name.
pub(crate) const PROJECTION: &str = "lc_totals";
/// The message type.
pub(crate) const MESSAGE_TYPE: &str = "lc.recorded";
/// The retry policy's `max_attempts`: small, so that messages dead-letter.
pub(crate) const MAX_ATTEMPTS: u32 = 2;
/// The first retry delay.
pub(crate) const INITIAL: Duration = Duration::from_secs(2);
/// The longest retry delay.
pub(crate) const MAX_DELAY: Duration = Duration::from_secs(6);

/// What the handler does on one attempt of one key.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Act {
    /// Adds the amount, returns `Ok`.
    Apply,
    /// Adds the amount, then fails transiently (the addition rolls back).
    Transient,
    /// Fails permanently.
    Permanent,
    /// Panics.
    Panic,
}

impl std::fmt::Debug for Act {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Apply => "apply",
            Self::Transient => "transient",
            Self::Permanent => "permanent",
            Self::Panic => "panic",
        })
    }
}

/// Per key, what the handler does on attempts 1 and 2.
pub(crate) type Acts = [Act; MAX_ATTEMPTS as usize];

/// The event a ledger row produces.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Recorded {
    pub(crate) user: i64,
    pub(crate) day: String,
    pub(crate) amount: i64,
}

impl Recorded {
    pub(crate) fn envelope(&self, key: &str) -> Envelope {
        let payload = serde_json::to_vec(self).unwrap_or_default();
        match MessageKey::new(key) {
            Ok(key) => Envelope::new(key, MESSAGE_TYPE, payload),
            Err(err) => panic!("test key {key:?}: {err}"),
        }
    }
}

/// A projection row: a user's total of one day.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Total {
    pub(crate) user: i64,
    pub(crate) total: i64,
}

impl ProjectionRow for Total {
    fn row_key(&self) -> String {
        self.user.to_string()
    }

    fn measure(&self) -> f64 {
        self.total as f64
    }
}

/// The SQL of the world, on either backend.
pub(crate) trait LcDb: diesel::Connection + Send + 'static {
    fn create_world(&mut self) -> QueryResult<()>;
    fn clear_world(&mut self) -> QueryResult<()>;
    fn insert_ledger(
        &mut self,
        id: i64,
        key: &str,
        user: i64,
        day: &str,
        amount: i64,
    ) -> QueryResult<()>;
    fn add_total(&mut self, user: i64, day: &str, amount: i64) -> QueryResult<()>;
    fn ledger_of(&mut self, day: &str) -> QueryResult<Vec<(String, i64, i64)>>;
    fn totals_of(&mut self, day: &str) -> QueryResult<Vec<Total>>;
    fn replace_day(&mut self, day: &str, rows: &[Total]) -> QueryResult<()>;
    fn all_totals(&mut self) -> QueryResult<BTreeMap<(i64, String), i64>>;
    /// (id, message key) of every dead letter, by id.
    fn letter_ids(&mut self) -> QueryResult<Vec<(i64, String)>>;
    /// (message key, replay sequence, published) of every outbox row.
    fn outbox_rows(&mut self) -> QueryResult<Vec<(String, i32, bool)>>;
}

#[derive(QueryableByName)]
struct LedgerRow {
    #[diesel(sql_type = Text)]
    message_key: String,
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = BigInt)]
    amount: i64,
}

#[derive(QueryableByName)]
struct TotalRow {
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = Text)]
    day: String,
    #[diesel(sql_type = BigInt)]
    total: i64,
}

#[derive(QueryableByName)]
struct LetterRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    message_key: String,
}

#[derive(QueryableByName)]
struct OutboxRow {
    #[diesel(sql_type = Text)]
    message_key: String,
    #[diesel(sql_type = Integer)]
    replay_seq: i32,
    #[diesel(sql_type = Integer)]
    published: i32,
}

const CREATE: &str = "\
    CREATE TABLE IF NOT EXISTS lc_ledger (id BIGINT PRIMARY KEY, message_key TEXT NOT NULL, \
        user_id BIGINT NOT NULL, day TEXT NOT NULL, amount BIGINT NOT NULL); \
    CREATE TABLE IF NOT EXISTS lc_totals (user_id BIGINT NOT NULL, day TEXT NOT NULL, \
        total BIGINT NOT NULL, PRIMARY KEY (user_id, day))";

const CLEAR: &str = "\
    DELETE FROM inbox_claims; DELETE FROM inbox_dead_letters; DELETE FROM outbox_messages; \
    DELETE FROM idempotency_keys; DELETE FROM inbox_group_halts; \
    DELETE FROM inbox_rebuild_runs; DELETE FROM lc_ledger; DELETE FROM lc_totals";

macro_rules! lc_db {
    ($conn:ty) => {
        impl LcDb for $conn {
            fn create_world(&mut self) -> QueryResult<()> {
                self.batch_execute(CREATE)
            }

            fn clear_world(&mut self) -> QueryResult<()> {
                self.batch_execute(CLEAR)
            }

            fn insert_ledger(
                &mut self,
                id: i64,
                key: &str,
                user: i64,
                day: &str,
                amount: i64,
            ) -> QueryResult<()> {
                diesel::sql_query(
                    "INSERT INTO lc_ledger (id, message_key, user_id, day, amount) \
                     VALUES ($1, $2, $3, $4, $5)",
                )
                .bind::<BigInt, _>(id)
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(user)
                .bind::<Text, _>(day)
                .bind::<BigInt, _>(amount)
                .execute(self)
                .map(|_| ())
            }

            fn add_total(&mut self, user: i64, day: &str, amount: i64) -> QueryResult<()> {
                diesel::sql_query(
                    "INSERT INTO lc_totals (user_id, day, total) VALUES ($1, $2, $3) \
                     ON CONFLICT (user_id, day) DO UPDATE SET total = lc_totals.total + excluded.total",
                )
                .bind::<BigInt, _>(user)
                .bind::<Text, _>(day)
                .bind::<BigInt, _>(amount)
                .execute(self)
                .map(|_| ())
            }

            fn ledger_of(&mut self, day: &str) -> QueryResult<Vec<(String, i64, i64)>> {
                let rows: Vec<LedgerRow> = diesel::sql_query(
                    "SELECT message_key, user_id, amount FROM lc_ledger WHERE day = $1 ORDER BY id",
                )
                .bind::<Text, _>(day)
                .load(self)?;
                Ok(rows
                    .into_iter()
                    .map(|r| (r.message_key, r.user_id, r.amount))
                    .collect())
            }

            fn totals_of(&mut self, day: &str) -> QueryResult<Vec<Total>> {
                let rows: Vec<TotalRow> = diesel::sql_query(
                    "SELECT user_id, day, total FROM lc_totals WHERE day = $1 ORDER BY user_id",
                )
                .bind::<Text, _>(day)
                .load(self)?;
                Ok(rows
                    .into_iter()
                    .map(|r| Total {
                        user: r.user_id,
                        total: r.total,
                    })
                    .collect())
            }

            fn replace_day(&mut self, day: &str, rows: &[Total]) -> QueryResult<()> {
                diesel::sql_query("DELETE FROM lc_totals WHERE day = $1")
                    .bind::<Text, _>(day)
                    .execute(self)?;
                for row in rows {
                    diesel::sql_query(
                        "INSERT INTO lc_totals (user_id, day, total) VALUES ($1, $2, $3)",
                    )
                    .bind::<BigInt, _>(row.user)
                    .bind::<Text, _>(day)
                    .bind::<BigInt, _>(row.total)
                    .execute(self)?;
                }
                Ok(())
            }

            fn all_totals(&mut self) -> QueryResult<BTreeMap<(i64, String), i64>> {
                let rows: Vec<TotalRow> =
                    diesel::sql_query("SELECT user_id, day, total FROM lc_totals").load(self)?;
                Ok(rows
                    .into_iter()
                    .map(|r| ((r.user_id, r.day), r.total))
                    .collect())
            }

            fn letter_ids(&mut self) -> QueryResult<Vec<(i64, String)>> {
                let rows: Vec<LetterRow> = diesel::sql_query(
                    "SELECT id, message_key FROM inbox_dead_letters ORDER BY id",
                )
                .load(self)?;
                Ok(rows.into_iter().map(|r| (r.id, r.message_key)).collect())
            }

            fn outbox_rows(&mut self) -> QueryResult<Vec<(String, i32, bool)>> {
                let rows: Vec<OutboxRow> = diesel::sql_query(
                    "SELECT message_key, replay_seq, \
                        CASE WHEN published_at IS NULL THEN 0 ELSE 1 END AS published \
                     FROM outbox_messages ORDER BY message_key, replay_seq",
                )
                .load(self)?;
                Ok(rows
                    .into_iter()
                    .map(|r| (r.message_key, r.replay_seq, r.published == 1))
                    .collect())
            }
        }
    };
}

lc_db!(PgConnection);
lc_db!(SqliteConnection);

/// The projection: a handler adding each event's amount to its user's total of its
/// day, and the hooks that recompute a day from the ledger.
pub(crate) struct Projection {
    group: ConsumerGroup,
    /// What the handler does per (key, attempt); a key not in it applies.
    pub(crate) acts: Arc<Mutex<HashMap<String, Acts>>>,
}

impl Projection {
    pub(crate) fn new() -> Self {
        Self {
            group: match ConsumerGroup::new(GROUP) {
                Ok(g) => g,
                Err(err) => panic!("{err}"),
            },
            acts: Arc::default(),
        }
    }
}

impl<C: LcDb> Handler<C> for Projection {
    type Message = Recorded;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        MESSAGE_TYPE
    }

    fn retry_policy(&self) -> RetryPolicy {
        match RetryPolicy::new(MAX_ATTEMPTS, INITIAL, MAX_DELAY) {
            Ok(p) => p,
            Err(err) => panic!("{err}"),
        }
    }

    fn lock(&self) -> Option<ProjectionLock> {
        Some(ProjectionLock::named(PROJECTION))
    }

    fn handle(
        &self,
        conn: &mut C,
        msg: Recorded,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        let key = ctx.message_key().as_str();
        let act = self
            .acts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .and_then(|a| {
                a.get(usize::try_from(ctx.attempt()).ok()?.checked_sub(1)?)
                    .copied()
            })
            .unwrap_or(Act::Apply);
        match act {
            Act::Apply => conn.add_total(msg.user, &msg.day, msg.amount)?,
            Act::Transient => {
                conn.add_total(msg.user, &msg.day, msg.amount)?;
                return Err(HandlerError::transient(format!(
                    "{key} failed after writing"
                )));
            }
            Act::Permanent => return Err(HandlerError::permanent(format!("{key} is invalid"))),
            Act::Panic => panic!("handler panicked on {key}"),
        }
        Ok(())
    }
}

impl<C: LcDb> Rebuild<C> for Projection {
    type Partition = String;
    type Source = (i64, i64);
    type Row = Total;

    fn projection(&self) -> &str {
        PROJECTION
    }

    fn window(&self, now: DateTime<Utc>, size: u32) -> Vec<String> {
        days_ending(now, size)
            .into_iter()
            .map(|d| d.to_string())
            .collect()
    }

    fn read_source(
        &self,
        conn: &mut C,
        day: &String,
    ) -> Result<Vec<SourceEvent<(i64, i64)>>, HookError> {
        let rows = conn.ledger_of(day)?;
        let read = rows
            .into_iter()
            .map(|(key, user, amount)| Ok((MessageKey::new(key)?, (user, amount))))
            .collect::<Result<Vec<_>, inbox_core::Error>>()?;
        Ok(read)
    }

    fn recompute(&self, _day: &String, source: &[SourceEvent<(i64, i64)>]) -> Vec<Total> {
        let mut sums: BTreeMap<i64, i64> = BTreeMap::new();
        for (_, (user, amount)) in source {
            *sums.entry(*user).or_default() += amount;
        }
        sums.into_iter()
            .map(|(user, total)| Total { user, total })
            .collect()
    }

    fn read_projection(&self, conn: &mut C, day: &String) -> Result<Vec<Total>, HookError> {
        Ok(conn.totals_of(day)?)
    }

    fn replace(&self, conn: &mut C, day: &String, rows: &[Total]) -> Result<(), HookError> {
        Ok(conn.replace_day(day, rows)?)
    }
}

/// The handlers' panics are expected: keep them off stderr, and every other panic on
/// it.
pub(crate) fn quiet_handler_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            if !message.starts_with("handler panicked on ") {
                default(info);
            }
        }));
    });
}
