-- Back to the counter: every row's token restarts at 1 (the random tokens have no
-- counter value), which fences off any request in flight, as the upgrade did.
CREATE TABLE idempotency_keys_old (
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
INSERT INTO idempotency_keys_old (caller, idempotency_key, fingerprint, status, lease_token,
    lease_until, committed_at, response, created_at, updated_at)
SELECT caller, idempotency_key, fingerprint, status, 1,
    lease_until, committed_at, response, created_at, updated_at
FROM idempotency_keys;
DROP TABLE idempotency_keys;
ALTER TABLE idempotency_keys_old RENAME TO idempotency_keys;
CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);
