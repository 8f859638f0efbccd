-- Fencing tokens of idempotency leases become 16 random bytes. A counter restarts
-- at 1 whenever a key's record is deleted and begun again (abandoned, purged), so a
-- stalled request's late commit could land on another request's record; a random
-- token names one lease of one record and never repeats.
-- Every row gets a fresh random token (randomblob, SQLite's generator seeded by the
-- operating system): no process holds a 16-byte token of a row written before, so a
-- request in flight across the upgrade is fenced off, and settled rows keep their
-- meaning. SQLite cannot change a column's type: the table is rebuilt.
CREATE TABLE idempotency_keys_new (
    caller           TEXT    NOT NULL,
    idempotency_key  TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    status           TEXT    NOT NULL CHECK (status IN ('in_flight', 'delivered', 'refunded')),
    lease_token      BLOB    NOT NULL CHECK (typeof(lease_token) = 'blob' AND length(lease_token) = 16),
    lease_until      TEXT    NOT NULL,
    committed_at     TEXT,
    response         BLOB,
    created_at       TEXT    NOT NULL,
    updated_at       TEXT    NOT NULL,
    PRIMARY KEY (caller, idempotency_key),
    CHECK (status <> 'delivered' OR response IS NOT NULL),
    CHECK (status = 'in_flight' OR committed_at IS NOT NULL)
) WITHOUT ROWID;
INSERT INTO idempotency_keys_new (caller, idempotency_key, fingerprint, status, lease_token,
    lease_until, committed_at, response, created_at, updated_at)
SELECT caller, idempotency_key, fingerprint, status, randomblob(16),
    lease_until, committed_at, response, created_at, updated_at
FROM idempotency_keys;
DROP TABLE idempotency_keys;
ALTER TABLE idempotency_keys_new RENAME TO idempotency_keys;
CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);
