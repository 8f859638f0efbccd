-- Idempotency keys of requests: one row per (caller, idempotency key). The primary
-- key is that pair, and it is the only unique constraint on the table
-- (verify_schema checks it). Keys compare byte by byte ("C").
CREATE TABLE idempotency_keys (
    caller           TEXT COLLATE "C" NOT NULL,
    idempotency_key  TEXT COLLATE "C" NOT NULL,
    -- HMAC-SHA-256 keyed by a secret the store never holds.
    fingerprint      BYTEA       NOT NULL CHECK (octet_length(fingerprint) = 32),
    status           TEXT        NOT NULL CHECK (status IN ('in_flight', 'delivered', 'refunded')),
    -- Fencing token of the lease: raised at every take-over.
    lease_token      BIGINT      NOT NULL,
    lease_until      TIMESTAMPTZ NOT NULL,
    -- Set in the transaction of the request's effect: never executed again.
    committed_at     TIMESTAMPTZ,
    response         BYTEA,
    created_at       TIMESTAMPTZ NOT NULL,
    updated_at       TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (caller, idempotency_key),
    CHECK (status <> 'delivered' OR response IS NOT NULL),
    CHECK (status = 'in_flight' OR committed_at IS NOT NULL)
);
CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);
