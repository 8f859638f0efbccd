-- The outbox: rows written in the business transaction, published later by relays
-- that lease them (leased_until, leased_by) and mark them published.
-- Timestamps are RFC 3339 text in UTC, which sorts in time order.
CREATE TABLE outbox_messages (
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
    last_error    TEXT
);

-- Leasing walks the unpublished rows in id order, and asks per ordering key whether
-- an earlier row is still unpublished; both stay small however large the table grows.
CREATE INDEX outbox_messages_unpublished ON outbox_messages (id) WHERE published_at IS NULL;
CREATE INDEX outbox_messages_ordering ON outbox_messages (ordering_key, id) WHERE published_at IS NULL;
-- Retention deletes published rows oldest first.
CREATE INDEX outbox_messages_published ON outbox_messages (published_at) WHERE published_at IS NOT NULL;

-- Retention deletes done claims oldest first (not unique: verify_schema ignores it).
CREATE INDEX inbox_claims_done ON inbox_claims (updated_at) WHERE status = 'done';
