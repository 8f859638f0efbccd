-- The metered API's own tables, in its schema (metered by default), beside the
-- framework's (outbox, claims, idempotency keys). Money is guarded here: the CHECK
-- constraints hold whatever the code above them does.
CREATE TABLE IF NOT EXISTS accounts (
    id          BIGSERIAL   PRIMARY KEY,
    balance     BIGINT      NOT NULL CONSTRAINT balance_not_negative CHECK (balance >= 0),
    created_at  TIMESTAMPTZ NOT NULL
);

-- The raw API key is never stored: only its SHA-256, to find the key by. The
-- request fingerprint is an HMAC keyed by the raw key, so no column here lets the
-- database recompute it.
CREATE TABLE IF NOT EXISTS api_keys (
    id          BIGSERIAL   PRIMARY KEY,
    account_id  BIGINT      NOT NULL REFERENCES accounts (id),
    key_digest  BYTEA       NOT NULL UNIQUE,
    spend_cap   BIGINT      NOT NULL CHECK (spend_cap >= 0),
    spent       BIGINT      NOT NULL DEFAULT 0 CHECK (spent >= 0),
    status      TEXT        NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'revoked')),
    created_at  TIMESTAMPTZ NOT NULL,
    CONSTRAINT spend_within_cap CHECK (spent <= spend_cap)
);

-- usage_ref is a usage's identity outside this database (its settlement message's
-- key and body): random, where an id from the sequence can come round again after a
-- failover that lost the usage.
CREATE TABLE IF NOT EXISTS usage_events (
    id               BIGSERIAL   PRIMARY KEY,
    usage_ref        TEXT        NOT NULL UNIQUE DEFAULT gen_random_uuid()::text,
    account_id       BIGINT      NOT NULL REFERENCES accounts (id),
    api_key_id       BIGINT      NOT NULL REFERENCES api_keys (id),
    amount           BIGINT      NOT NULL CHECK (amount > 0),
    model            TEXT        NOT NULL,
    idempotency_key  TEXT,
    lease_token      BYTEA,
    status           TEXT        NOT NULL CHECK (status IN ('debited', 'delivered', 'refunded')),
    deadline_at      TIMESTAMPTZ NOT NULL,
    created_at       TIMESTAMPTZ NOT NULL,
    settled_at       TIMESTAMPTZ
);
-- A table from before usage_ref: each usage's is its id, the key its settlement
-- message already has.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema()
                   AND table_name = 'usage_events' AND column_name = 'usage_ref') THEN
        ALTER TABLE usage_events ADD COLUMN usage_ref TEXT UNIQUE;
        UPDATE usage_events SET usage_ref = id::text;
        ALTER TABLE usage_events ALTER COLUMN usage_ref SET DEFAULT gen_random_uuid()::text,
            ALTER COLUMN usage_ref SET NOT NULL;
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS usage_events_by_key ON usage_events (account_id, idempotency_key);

-- Append-only: a balance always equals the sum of its account's rows.
CREATE TABLE IF NOT EXISTS ledger (
    id          BIGSERIAL   PRIMARY KEY,
    account_id  BIGINT      NOT NULL REFERENCES accounts (id),
    usage_id    BIGINT      REFERENCES usage_events (id),
    kind        TEXT        NOT NULL CHECK (kind IN ('grant', 'debit', 'refund')),
    amount      BIGINT      NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_by_account ON ledger (account_id);
-- A usage is refunded at most once, whoever refunds it.
CREATE UNIQUE INDEX IF NOT EXISTS ledger_one_refund_per_usage ON ledger (usage_id)
    WHERE kind = 'refund';
