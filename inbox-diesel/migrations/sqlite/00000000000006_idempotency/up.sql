-- Idempotency keys of requests: one row per (caller, idempotency key). The primary
-- key is that pair, and it is the only unique constraint on the table
-- (verify_schema checks it). Timestamps are RFC 3339 text in UTC.
CREATE TABLE idempotency_keys (
    caller           TEXT    NOT NULL,
    idempotency_key  TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    status           TEXT    NOT NULL CHECK (status IN ('in_flight', 'delivered', 'refunded')),
    lease_token      INTEGER NOT NULL,
    lease_until      TEXT    NOT NULL,
    committed_at     TEXT,
    response         BLOB,
    created_at       TEXT    NOT NULL,
    updated_at       TEXT    NOT NULL,
    PRIMARY KEY (caller, idempotency_key),
    CHECK (status <> 'delivered' OR response IS NOT NULL),
    CHECK (status = 'in_flight' OR committed_at IS NOT NULL)
) WITHOUT ROWID;
CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);
