-- A row whose publication failed its last attempt is dead: kept, never leased again,
-- listed for operators (dead_at is when it died, RFC 3339 text in UTC).
--
-- No transaction id here, unlike PostgreSQL: SQLite has one writer at a time (the
-- store writes in immediate transactions), so ids are handed out in commit order and
-- id order is the order ordered rows go out in.
ALTER TABLE outbox_messages ADD COLUMN dead_at TEXT;

DROP INDEX outbox_messages_unpublished;
DROP INDEX outbox_messages_ordering;
CREATE INDEX outbox_messages_unpublished ON outbox_messages (id)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX outbox_messages_ordering ON outbox_messages (ordering_key, id)
    WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL;
CREATE INDEX outbox_messages_dead ON outbox_messages (dead_at, id) WHERE dead_at IS NOT NULL;
