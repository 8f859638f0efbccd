//! The service's money, in PostgreSQL: accounts (the balance), API keys (the spend
//! cap), usage rows and the append-only ledger. The guarantees are the CHECK
//! constraints; the debit is one statement; debit and refund take the same two row
//! locks in the same order: the account's balance row, then the API key's row (then
//! the usage row, then the idempotency record).

use chrono::{DateTime, Utc};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Binary, Nullable, Text, Timestamptz};
use diesel::PgConnection;
use inbox_core::idempotency::{IdempotencyKey, LeaseToken, Settlement};
use inbox_core::{MessageKey, OutboxMessage};

/// The service's own tables, created if missing (in the store's schema, the first
/// of the connection's search path).
pub const SCHEMA_SQL: &str = include_str!("schema.sql");

/// Serialises concurrent schema set-ups of several instances.
const SCHEMA_LOCK: i64 = 0x6d65_7465_7265_6401;

/// The message type of a settlement due at a request's deadline plus the margin.
pub const SETTLEMENT_TYPE: &str = "metered.settlement_due";

/// The consumer group that settles what a dead process left.
pub const SETTLEMENT_GROUP: &str = "metered.settlement";

/// Creates the tables if missing, under a transaction-scoped advisory lock: two
/// instances setting up one fresh schema at once would otherwise race in
/// PostgreSQL's catalog (both see no table, the second's insert into `pg_type` waits
/// for the first and fails with a duplicate key when it commits). With the lock the
/// second waits for the first's commit and finds the tables
/// (`tests/metered_api.rs`: `two_instances_set_up_one_fresh_schema_at_once`).
pub fn create_schema(conn: &mut PgConnection) -> QueryResult<()> {
    conn.transaction(|conn| {
        diesel::sql_query("SELECT pg_advisory_xact_lock($1)")
            .bind::<BigInt, _>(SCHEMA_LOCK)
            .execute(conn)?;
        conn.batch_execute(SCHEMA_SQL)
    })
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Opens an account with `balance` credits (a `grant` ledger row).
pub fn create_account(
    conn: &mut PgConnection,
    balance: i64,
    now: DateTime<Utc>,
) -> QueryResult<i64> {
    conn.transaction(|conn| {
        let account: Id = diesel::sql_query(
            "INSERT INTO accounts (balance, created_at) VALUES ($1, $2) RETURNING id",
        )
        .bind::<BigInt, _>(balance)
        .bind::<Timestamptz, _>(now)
        .get_result(conn)?;
        diesel::sql_query(
            "INSERT INTO ledger (account_id, kind, amount, created_at) VALUES ($1, 'grant', $2, $3)",
        )
        .bind::<BigInt, _>(account.id)
        .bind::<BigInt, _>(balance)
        .bind::<Timestamptz, _>(now)
        .execute(conn)?;
        Ok(account.id)
    })
}

/// Adds an API key to an account; `None` when there is no such account.
pub fn create_key(
    conn: &mut PgConnection,
    account: i64,
    digest: &[u8],
    spend_cap: i64,
    now: DateTime<Utc>,
) -> QueryResult<Option<i64>> {
    let row: Option<Id> = diesel::sql_query(
        "INSERT INTO api_keys (account_id, key_digest, spend_cap, created_at) \
         SELECT id, $2, $3, $4 FROM accounts WHERE id = $1 RETURNING id",
    )
    .bind::<BigInt, _>(account)
    .bind::<Binary, _>(digest)
    .bind::<BigInt, _>(spend_cap)
    .bind::<Timestamptz, _>(now)
    .get_result(conn)
    .optional()?;
    Ok(row.map(|r| r.id))
}

#[derive(QueryableByName)]
struct KeyRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = BigInt)]
    account_id: i64,
}

/// An active key by its digest: (account, key id).
pub fn find_key(conn: &mut PgConnection, digest: &[u8]) -> QueryResult<Option<(i64, i64)>> {
    let row: Option<KeyRow> = diesel::sql_query(
        "SELECT id, account_id FROM api_keys WHERE key_digest = $1 AND status = 'active'",
    )
    .bind::<Binary, _>(digest)
    .get_result(conn)
    .optional()?;
    Ok(row.map(|r| (r.account_id, r.id)))
}

/// What `GET /v1/balance` shows.
#[derive(QueryableByName, Debug, Clone, Copy)]
pub struct Balance {
    /// The account.
    #[diesel(sql_type = BigInt)]
    pub account_id: i64,
    /// Its balance.
    #[diesel(sql_type = BigInt)]
    pub balance: i64,
    /// The key's cap.
    #[diesel(sql_type = BigInt)]
    pub spend_cap: i64,
    /// What the key has spent.
    #[diesel(sql_type = BigInt)]
    pub spent: i64,
}

/// The balance of the key's account and the key's spending.
pub fn balance(conn: &mut PgConnection, key_id: i64) -> QueryResult<Option<Balance>> {
    diesel::sql_query(
        "SELECT a.id AS account_id, a.balance, k.spend_cap, k.spent \
         FROM api_keys k JOIN accounts a ON a.id = k.account_id WHERE k.id = $1",
    )
    .bind::<BigInt, _>(key_id)
    .get_result(conn)
    .optional()
}

/// An account with its ledger's sum.
#[derive(QueryableByName, Debug, Clone, Copy)]
pub struct AccountSummary {
    /// The account.
    #[diesel(sql_type = BigInt)]
    pub account_id: i64,
    /// Its balance.
    #[diesel(sql_type = BigInt)]
    pub balance: i64,
    /// The sum of its ledger rows.
    #[diesel(sql_type = BigInt)]
    pub ledger_sum: i64,
    /// How many ledger rows it has.
    #[diesel(sql_type = BigInt)]
    pub ledger_entries: i64,
    /// Refund rows among them.
    #[diesel(sql_type = BigInt)]
    pub refunds: i64,
}

/// The account's balance beside its ledger.
pub fn account_summary(
    conn: &mut PgConnection,
    account: i64,
) -> QueryResult<Option<AccountSummary>> {
    diesel::sql_query(
        "SELECT a.id AS account_id, a.balance, \
                coalesce((SELECT sum(amount) FROM ledger l WHERE l.account_id = a.id), 0)::bigint \
                    AS ledger_sum, \
                (SELECT count(*) FROM ledger l WHERE l.account_id = a.id) AS ledger_entries, \
                (SELECT count(*) FROM ledger l WHERE l.account_id = a.id AND l.kind = 'refund') \
                    AS refunds \
         FROM accounts a WHERE a.id = $1",
    )
    .bind::<BigInt, _>(account)
    .get_result(conn)
    .optional()
}

/// A usage row.
#[derive(QueryableByName, Debug, Clone)]
pub struct Usage {
    /// Its id.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// The account charged.
    #[diesel(sql_type = BigInt)]
    pub account_id: i64,
    /// The cost.
    #[diesel(sql_type = BigInt)]
    pub amount: i64,
    /// The model.
    #[diesel(sql_type = Text)]
    pub model: String,
    /// `debited`, `delivered` or `refunded`.
    #[diesel(sql_type = Text)]
    pub status: String,
    /// The idempotency key, if the request had one.
    #[diesel(sql_type = Nullable<Text>)]
    pub idempotency_key: Option<String>,
    /// Its lease token (16 bytes, see `inbox_core::idempotency::LeaseToken`).
    #[diesel(sql_type = Nullable<Binary>)]
    pub lease_token: Option<Vec<u8>>,
    /// Refund ledger rows of this usage (0 or 1).
    #[diesel(sql_type = BigInt)]
    pub refunds: i64,
}

const USAGE_COLUMNS: &str = "u.id, u.account_id, u.amount, u.model, u.status, u.idempotency_key, \
     u.lease_token, (SELECT count(*) FROM ledger l WHERE l.usage_id = u.id AND l.kind = 'refund') \
     AS refunds";

/// A usage row by id.
pub fn usage(conn: &mut PgConnection, id: i64) -> QueryResult<Option<Usage>> {
    diesel::sql_query(format!(
        "SELECT {USAGE_COLUMNS} FROM usage_events u WHERE u.id = $1"
    ))
    .bind::<BigInt, _>(id)
    .get_result(conn)
    .optional()
}

/// The latest usage row of an account's idempotency key.
pub fn usage_by_key(
    conn: &mut PgConnection,
    account: i64,
    key: &str,
) -> QueryResult<Option<Usage>> {
    diesel::sql_query(format!(
        "SELECT {USAGE_COLUMNS} FROM usage_events u \
         WHERE u.account_id = $1 AND u.idempotency_key = $2 ORDER BY u.id DESC LIMIT 1"
    ))
    .bind::<BigInt, _>(account)
    .bind::<Text, _>(key)
    .get_result(conn)
    .optional()
}

/// Why a debit was refused.
#[derive(Debug, thiserror::Error)]
pub enum DebitError {
    /// The balance's CHECK refused it.
    #[error("insufficient credits")]
    InsufficientCredits,
    /// The key's spend cap CHECK refused it.
    #[error("spend cap reached")]
    SpendCapReached,
    /// The key is no longer active (re-checked in the debit).
    #[error("the API key is not active")]
    KeyInactive,
    /// The idempotency lease was taken over: this request may not commit.
    #[error("the idempotency lease was taken over")]
    Fenced,
    /// The settlement message could not be encoded.
    #[error("encoding the settlement message failed")]
    Encode(#[source] serde_json::Error),
    /// Anything else.
    #[error(transparent)]
    Store(#[from] inbox_diesel::Error),
}

impl From<DieselError> for DebitError {
    fn from(err: DieselError) -> Self {
        if let DieselError::DatabaseError(DatabaseErrorKind::CheckViolation, info) = &err {
            match info.constraint_name() {
                Some("balance_not_negative") => return Self::InsufficientCredits,
                Some("spend_within_cap") => return Self::SpendCapReached,
                _ => {}
            }
        }
        Self::Store(err.into())
    }
}

/// A request to debit.
#[derive(Debug, Clone)]
pub struct Debit<'a> {
    /// The account.
    pub account: i64,
    /// The API key.
    pub key_id: i64,
    /// The cost.
    pub amount: i64,
    /// The model.
    pub model: &'a str,
    /// The idempotency key and its lease token, if any.
    pub idempotency: Option<(&'a IdempotencyKey, LeaseToken)>,
    /// The request's deadline.
    pub deadline: DateTime<Utc>,
    /// When the settlement message is due (deadline plus margin).
    pub settle_at: DateTime<Utc>,
    /// The exchange of the settlement message.
    pub exchange: &'a str,
}

#[derive(QueryableByName)]
struct Debited {
    #[diesel(sql_type = BigInt)]
    usage_id: i64,
    #[diesel(sql_type = Text)]
    usage_ref: String,
    #[diesel(sql_type = BigInt)]
    balance: i64,
}

/// The debit: one statement that takes the balance row, then the key row (the
/// `EXISTS (SELECT 1 FROM bal)` makes the key's update wait for the balance's),
/// appends the usage and the ledger rows. The balance and the cap are CHECK
/// constraints; the key's state is re-checked here, whatever a cache said.
const DEBIT: &str = "\
    WITH bal AS ( \
        UPDATE accounts SET balance = balance - $3 \
        WHERE id = $1 AND EXISTS ( \
            SELECT 1 FROM api_keys WHERE id = $2 AND account_id = $1 AND status = 'active') \
        RETURNING id, balance \
    ), k AS ( \
        UPDATE api_keys SET spent = spent + $3 \
        WHERE id = $2 AND account_id = $1 AND status = 'active' AND EXISTS (SELECT 1 FROM bal) \
        RETURNING id \
    ), u AS ( \
        INSERT INTO usage_events (account_id, api_key_id, amount, model, idempotency_key, \
            lease_token, status, deadline_at, created_at) \
        SELECT $1, k.id, $3, $4, $5, $6, 'debited', $7, $8 FROM k \
        RETURNING id, usage_ref \
    ), led AS ( \
        INSERT INTO ledger (account_id, usage_id, kind, amount, created_at) \
        SELECT $1, u.id, 'debit', -$3, $8 FROM u \
        RETURNING usage_id \
    ) \
    SELECT led.usage_id AS usage_id, u.usage_ref AS usage_ref, bal.balance AS balance \
    FROM led, bal, u";

/// The settlement message's body.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct SettlementDue {
    /// The usage to settle.
    pub usage_id: i64,
    /// Its `usage_ref`: a message for a usage a failover lost names an id the
    /// sequence may have handed to another usage since, and must leave that one
    /// alone. Absent in a message written before the column (it settles by id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage_ref: Option<String>,
}

/// A debited usage, as the debit returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DebitedUsage {
    /// The usage's id.
    pub usage_id: i64,
    /// Its `usage_ref`, random: the request that debited it marks it delivered or
    /// refunds it by its id and this, so that a failover that lost the debit (and
    /// handed the id to another usage since) cannot make the request settle another
    /// request's usage.
    pub usage_ref: String,
    /// The account's balance after the debit.
    pub balance: i64,
}

/// Debits, marks the idempotency record committed (fenced by its token) and
/// enqueues the settlement, all in one transaction.
pub fn debit(
    conn: &mut PgConnection,
    d: &Debit<'_>,
    now: DateTime<Utc>,
) -> Result<DebitedUsage, DebitError> {
    conn.transaction(|conn| {
        let row: Option<Debited> = diesel::sql_query(DEBIT)
            .bind::<BigInt, _>(d.account)
            .bind::<BigInt, _>(d.key_id)
            .bind::<BigInt, _>(d.amount)
            .bind::<Text, _>(d.model)
            .bind::<Nullable<Text>, _>(d.idempotency.map(|(k, _)| k.as_str()))
            .bind::<Nullable<Binary>, _>(d.idempotency.map(|(_, t)| t.as_bytes().to_vec()))
            .bind::<Timestamptz, _>(d.deadline)
            .bind::<Timestamptz, _>(now)
            .get_result(conn)
            .optional()?;
        let Some(row) = row else {
            return Err(DebitError::KeyInactive);
        };
        if let Some((key, token)) = d.idempotency {
            match inbox_diesel::idempotency::commit_request(
                conn,
                &d.account.to_string(),
                key,
                token,
                now,
            ) {
                Ok(()) => {}
                Err(inbox_diesel::Error::Fenced { .. }) => return Err(DebitError::Fenced),
                Err(e) => return Err(e.into()),
            }
        }
        let body = serde_json::to_vec(&SettlementDue {
            usage_id: row.usage_id,
            usage_ref: Some(row.usage_ref.clone()),
        })
        .map_err(DebitError::Encode)?;
        let message = OutboxMessage::new(
            // From usage_ref, not the id (see `SettlementDue::usage_ref`); a usage
            // from before the column has its id as usage_ref, and the same key.
            MessageKey::derive("metered", &row.usage_ref, SETTLEMENT_TYPE),
            d.exchange,
            SETTLEMENT_TYPE,
            body,
        )
        .with_not_before(d.settle_at);
        inbox_diesel::enqueue(conn, &message, now)?;
        Ok(DebitedUsage {
            usage_id: row.usage_id,
            usage_ref: row.usage_ref,
            balance: row.balance,
        })
    })
}

/// Marks a usage delivered (a guarded write from `debited`, of the usage `usage`
/// names by id and `usage_ref`) and saves the response on its idempotency record,
/// in one transaction. `false`: it was settled already (refunded at its deadline),
/// or it is gone (a failover lost the debit): the response must not be sent as a
/// success.
pub fn deliver(
    conn: &mut PgConnection,
    usage: &DebitedUsage,
    idempotency: Option<(i64, &IdempotencyKey, LeaseToken)>,
    response: &[u8],
    now: DateTime<Utc>,
) -> inbox_diesel::Result<bool> {
    conn.transaction(|conn| {
        let marked = diesel::sql_query(
            "UPDATE usage_events SET status = 'delivered', settled_at = $2 \
             WHERE id = $1 AND usage_ref = $3 AND status = 'debited'",
        )
        .bind::<BigInt, _>(usage.usage_id)
        .bind::<Timestamptz, _>(now)
        .bind::<Text, _>(&usage.usage_ref)
        .execute(conn)?;
        if marked != 1 {
            return Ok(false);
        }
        if let Some((account, key, token)) = idempotency {
            let settled = inbox_diesel::idempotency::settle_request(
                conn,
                &account.to_string(),
                key,
                token,
                &Settlement::Delivered {
                    response: response.to_vec(),
                },
                now,
            )?;
            if !settled {
                // The usage row said debited: its record must be in flight.
                return Err(inbox_diesel::Error::Internal(
                    "a debited usage's idempotency record was not in flight",
                ));
            }
        }
        Ok(true)
    })
}

#[derive(QueryableByName)]
struct Refunded {
    #[diesel(sql_type = BigInt)]
    account_id: i64,
    #[diesel(sql_type = Nullable<Text>)]
    idempotency_key: Option<String>,
    #[diesel(sql_type = Nullable<Binary>)]
    lease_token: Option<Vec<u8>>,
}

/// The refund: the same two row locks in the same order as the debit (balance,
/// then key), then the guarded write of the usage row from `$3` (`debited`; an
/// operator's refund: `delivered`), then the
/// ledger row. A refund racing another finds the usage no longer debited; its
/// statement returns nothing and its transaction is rolled back.
const REFUND: &str = "\
    WITH u AS ( \
        SELECT id, account_id, api_key_id, amount FROM usage_events \
        WHERE id = $1 AND status = $3 AND ($4::text IS NULL OR usage_ref = $4) \
    ), bal AS ( \
        UPDATE accounts a SET balance = a.balance + u.amount FROM u \
        WHERE a.id = u.account_id RETURNING a.id \
    ), k AS ( \
        UPDATE api_keys kk SET spent = kk.spent - u.amount FROM u \
        WHERE kk.id = u.api_key_id AND EXISTS (SELECT 1 FROM bal) RETURNING kk.id \
    ), mark AS ( \
        UPDATE usage_events e SET status = 'refunded', settled_at = $2 \
        WHERE e.id = $1 AND e.status = $3 AND ($4::text IS NULL OR e.usage_ref = $4) \
            AND EXISTS (SELECT 1 FROM k) \
        RETURNING e.id, e.account_id, e.amount, e.idempotency_key, e.lease_token \
    ), led AS ( \
        INSERT INTO ledger (account_id, usage_id, kind, amount, created_at) \
        SELECT account_id, id, 'refund', amount, $2 FROM mark RETURNING usage_id \
    ) \
    SELECT mark.account_id, mark.idempotency_key, mark.lease_token FROM mark, led";

/// Why a refund wrote nothing.
#[derive(Debug, thiserror::Error)]
enum RefundError {
    #[error("not debited")]
    NotDebited,
    #[error(transparent)]
    Store(#[from] inbox_diesel::Error),
}

impl From<DieselError> for RefundError {
    fn from(err: DieselError) -> Self {
        Self::Store(err.into())
    }
}

/// Refunds the usage `usage` names (by id and `usage_ref`) if it is still `debited`
/// (and its idempotency record with it); returns whether this call refunded it.
/// Safe to call from any process, any number of times: exactly one refund can win.
pub fn refund(
    conn: &mut PgConnection,
    usage: &DebitedUsage,
    now: DateTime<Utc>,
) -> inbox_diesel::Result<bool> {
    refund_from(conn, usage.usage_id, Some(&usage.usage_ref), "debited", now)
}

/// The settlement of `due`: refunds its usage if it is still `debited` and is the
/// usage the message was written for (its `usage_ref`, when the message has one: a
/// failover that lost the usage can have handed its id to another since); returns
/// whether this call refunded it.
pub fn settle(
    conn: &mut PgConnection,
    due: &SettlementDue,
    now: DateTime<Utc>,
) -> inbox_diesel::Result<bool> {
    refund_from(conn, due.usage_id, due.usage_ref.as_deref(), "debited", now)
}

/// An operator's refund of a delivered usage: the same statement from `delivered`,
/// and the idempotency record from delivered to refunded (a replay being served
/// sees it when it checks again, and ends with an error line).
pub fn refund_delivered(
    conn: &mut PgConnection,
    usage_id: i64,
    now: DateTime<Utc>,
) -> inbox_diesel::Result<bool> {
    refund_from(conn, usage_id, None, "delivered", now)
}

fn refund_from(
    conn: &mut PgConnection,
    usage_id: i64,
    usage_ref: Option<&str>,
    from: &'static str,
    now: DateTime<Utc>,
) -> inbox_diesel::Result<bool> {
    let outcome = conn.transaction(|conn| {
        let row: Option<Refunded> = diesel::sql_query(REFUND)
            .bind::<BigInt, _>(usage_id)
            .bind::<Timestamptz, _>(now)
            .bind::<Text, _>(from)
            .bind::<Nullable<Text>, _>(usage_ref)
            .get_result(conn)
            .optional()?;
        let Some(row) = row else {
            // Nothing marked: roll back whatever the balance and key updates did.
            return Err(RefundError::NotDebited);
        };
        if let (Some(key), Some(token)) = (row.idempotency_key, row.lease_token) {
            let key = IdempotencyKey::new(key).map_err(inbox_diesel::Error::from)?;
            let caller = row.account_id.to_string();
            let token = LeaseToken::from_slice(&token).ok_or_else(|| {
                inbox_diesel::Error::CorruptIdempotencyRecord {
                    caller: caller.clone(),
                    key: key.as_str().to_owned(),
                    reason: format!("a usage row's lease token of {} bytes", token.len()),
                }
            })?;
            if from == "delivered" {
                inbox_diesel::idempotency::refund_delivered_request(
                    conn, &caller, &key, token, now,
                )?;
            } else {
                inbox_diesel::idempotency::settle_request(
                    conn,
                    &caller,
                    &key,
                    token,
                    &Settlement::Refunded,
                    now,
                )?;
            }
        }
        Ok(())
    });
    match outcome {
        Ok(()) => Ok(true),
        Err(RefundError::NotDebited) => Ok(false),
        Err(RefundError::Store(e)) => Err(e),
    }
}
