//! PostgreSQL's idempotency statements; the table's catalog is read like the
//! claim table's.

use diesel::PgConnection;

mod sql {
    /// The insert takes a free key with a new random token ($6); the conflict
    /// branch takes over only an uncommitted, in-flight record whose lease has
    /// ended, with the same fingerprint, giving it the new token. Concurrent
    /// requests with one key wait on the unique index (or the row's lock) for the
    /// first to commit, then judge its new row version: taken.
    pub(super) const BEGIN: &str = "\
        INSERT INTO idempotency_keys (caller, idempotency_key, fingerprint, status, \
            lease_token, lease_until, created_at, updated_at) \
        VALUES ($1, $2, $3, 'in_flight', $6, $4, $5, $5) \
        ON CONFLICT (caller, idempotency_key) DO UPDATE \
            SET lease_token = EXCLUDED.lease_token, \
                lease_until = EXCLUDED.lease_until, updated_at = EXCLUDED.updated_at \
            WHERE idempotency_keys.status = 'in_flight' \
              AND idempotency_keys.committed_at IS NULL \
              AND idempotency_keys.lease_until <= EXCLUDED.updated_at \
              AND idempotency_keys.fingerprint = EXCLUDED.fingerprint \
        RETURNING lease_token";

    pub(super) const READ: &str = "\
        SELECT caller, idempotency_key, fingerprint, status, lease_token, lease_until, \
               committed_at, response, created_at, updated_at \
        FROM idempotency_keys WHERE caller = $1 AND idempotency_key = $2";

    pub(super) const COMMIT: &str = "\
        UPDATE idempotency_keys SET committed_at = $4, updated_at = $4 \
        WHERE caller = $1 AND idempotency_key = $2 AND lease_token = $3 \
          AND status = 'in_flight' AND committed_at IS NULL";

    pub(super) const SETTLE: &str = "\
        UPDATE idempotency_keys SET status = $4, response = $5, updated_at = $6 \
        WHERE caller = $1 AND idempotency_key = $2 AND lease_token = $3 \
          AND status = 'in_flight' AND committed_at IS NOT NULL";

    pub(super) const REFUND_DELIVERED: &str = "\
        UPDATE idempotency_keys SET status = 'refunded', response = NULL, updated_at = $4 \
        WHERE caller = $1 AND idempotency_key = $2 AND lease_token = $3 \
          AND status = 'delivered'";

    pub(super) const ABANDON: &str = "\
        DELETE FROM idempotency_keys \
        WHERE caller = $1 AND idempotency_key = $2 AND lease_token = $3 \
          AND status = 'in_flight' AND committed_at IS NULL";

    pub(super) const TOKEN_TYPE: &str = "bytea";
}

crate::idempotency::idempotency_ops!(PgConnection, sql);
