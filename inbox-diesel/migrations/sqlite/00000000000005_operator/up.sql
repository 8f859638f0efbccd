-- Operator tooling. A replay is an outbox row that keeps the original message key
-- (a new key would be a new claim, applied twice), so outbox rows are unique by
-- (key, replay sequence): 0 for the producer's own row, 1, 2, ... for replays.
-- SQLite cannot drop a column's UNIQUE: the table is rebuilt, ids and the
-- AUTOINCREMENT counter kept.
CREATE TABLE outbox_messages_new (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    message_key   TEXT    NOT NULL,
    exchange      TEXT    NOT NULL,
    routing_key   TEXT    NOT NULL,
    message_type  TEXT    NOT NULL,
    tenant        TEXT,
    payload       BLOB    NOT NULL,
    headers       TEXT    NOT NULL,
    ordering_key  TEXT,
    created_at    TEXT    NOT NULL,
    available_at  TEXT    NOT NULL,
    leased_until  TEXT,
    leased_by     TEXT,
    published_at  TEXT,
    attempts      INTEGER NOT NULL DEFAULT 0,
    last_error    TEXT,
    dead_at       TEXT,
    replay_seq    INTEGER NOT NULL DEFAULT 0,
    CONSTRAINT outbox_messages_key_replay UNIQUE (message_key, replay_seq)
);
INSERT INTO outbox_messages_new (id, message_key, exchange, routing_key, message_type,
        tenant, payload, headers, ordering_key, created_at, available_at, leased_until,
        leased_by, published_at, attempts, last_error, dead_at, replay_seq)
    SELECT id, message_key, exchange, routing_key, message_type, tenant, payload, headers,
        ordering_key, created_at, available_at, leased_until, leased_by, published_at,
        attempts, last_error, dead_at, 0
    FROM outbox_messages;
INSERT INTO sqlite_sequence (name, seq)
    SELECT 'outbox_messages_new', seq FROM sqlite_sequence WHERE name = 'outbox_messages'
    AND NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'outbox_messages_new');
UPDATE sqlite_sequence
    SET seq = max(seq, (SELECT coalesce(max(seq), 0) FROM sqlite_sequence WHERE name = 'outbox_messages'))
    WHERE name = 'outbox_messages_new';
DROP TABLE outbox_messages;
ALTER TABLE outbox_messages_new RENAME TO outbox_messages;
CREATE INDEX outbox_messages_published ON outbox_messages (published_at) WHERE published_at IS NOT NULL;
CREATE INDEX outbox_messages_unpublished ON outbox_messages (id)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX outbox_messages_ordering ON outbox_messages (ordering_key, id)
    WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL;
CREATE INDEX outbox_messages_dead ON outbox_messages (dead_at, id) WHERE dead_at IS NOT NULL;

-- How often a dead letter was replayed, and when an operator discarded (archived) it:
-- a discarded letter is kept for its own retention, never replayed, listed apart.
ALTER TABLE inbox_dead_letters ADD COLUMN replay_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE inbox_dead_letters ADD COLUMN discarded_at TEXT;

CREATE INDEX inbox_dead_letters_recent ON inbox_dead_letters (dead_lettered_at, id);
CREATE INDEX inbox_claims_failed ON inbox_claims (next_attempt_at) WHERE status = 'failed';

-- `selftest`: the canary handler records each arrival of a canary message (it runs
-- under the claim like any handler, so a second arrival means a doubled effect).
CREATE TABLE inbox_canary (
    run_id      TEXT    NOT NULL,
    seq         INTEGER NOT NULL,
    sent_at     TEXT    NOT NULL,
    arrived_at  TEXT    NOT NULL,
    arrivals    INTEGER NOT NULL,
    PRIMARY KEY (run_id, seq)
);

-- A consumer group halted by a claim invariant violation (a `Stop`), until an operator
-- resumes it: the consumer writes the row when the group halts, starts the group
-- halted while the row exists, and resumes it once the row is gone.
CREATE TABLE inbox_group_halts (
    consumer_group  TEXT        NOT NULL PRIMARY KEY,
    message_key     TEXT        NOT NULL,
    detail          TEXT        NOT NULL,
    halted_at       TEXT        NOT NULL
);
