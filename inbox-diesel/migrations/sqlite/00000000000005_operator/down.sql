DROP TABLE inbox_group_halts;
DROP TABLE inbox_canary;
DROP INDEX inbox_claims_failed;
DROP INDEX inbox_dead_letters_recent;
ALTER TABLE inbox_dead_letters DROP COLUMN discarded_at;
ALTER TABLE inbox_dead_letters DROP COLUMN replay_count;
DELETE FROM outbox_messages WHERE replay_seq <> 0;
CREATE TABLE outbox_messages_old (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    message_key   TEXT    NOT NULL UNIQUE,
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
    dead_at       TEXT
);
INSERT INTO outbox_messages_old SELECT id, message_key, exchange, routing_key, message_type,
        tenant, payload, headers, ordering_key, created_at, available_at, leased_until,
        leased_by, published_at, attempts, last_error, dead_at
    FROM outbox_messages;
DROP TABLE outbox_messages;
ALTER TABLE outbox_messages_old RENAME TO outbox_messages;
CREATE INDEX outbox_messages_published ON outbox_messages (published_at) WHERE published_at IS NOT NULL;
CREATE INDEX outbox_messages_unpublished ON outbox_messages (id)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX outbox_messages_ordering ON outbox_messages (ordering_key, id)
    WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL;
CREATE INDEX outbox_messages_dead ON outbox_messages (dead_at, id) WHERE dead_at IS NOT NULL;
