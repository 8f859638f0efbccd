DROP INDEX outbox_messages_dead;
DROP INDEX outbox_messages_ordering;
DROP INDEX outbox_messages_unpublished;
ALTER TABLE outbox_messages DROP COLUMN dead_at;
CREATE INDEX outbox_messages_unpublished ON outbox_messages (id) WHERE published_at IS NULL;
CREATE INDEX outbox_messages_ordering ON outbox_messages (ordering_key, id) WHERE published_at IS NULL;
