-- A row whose publication failed its last attempt is dead: kept, never leased again,
-- listed for operators (dead_at is when it died).
ALTER TABLE outbox_messages ADD COLUMN dead_at TIMESTAMPTZ;

-- The transaction that wrote the row. Ids are not commit order: a row with a lower id
-- can commit after one with a higher id. Rows with an ordering key are leased only
-- once their transaction is below every running transaction's id (so every row that
-- could precede them is visible), and go out per key in (xact_id, id) order.
-- Recorded for every row (it costs nothing: the inserting transaction has an id
-- anyway), only ordered rows wait for it. Added without a default first, then given
-- one, so existing rows are not rewritten (their NULL counts as long committed).
ALTER TABLE outbox_messages ADD COLUMN xact_id xid8;
ALTER TABLE outbox_messages ALTER COLUMN xact_id SET DEFAULT pg_current_xact_id();

-- Leasing walks the live rows (unpublished, not dead) in id order, and asks per
-- ordering key whether an earlier one in (xact_id, id) order is still live.
DROP INDEX outbox_messages_unpublished;
DROP INDEX outbox_messages_ordering;
CREATE INDEX outbox_messages_unpublished ON outbox_messages (id)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX outbox_messages_ordering ON outbox_messages (ordering_key, xact_id, id)
    WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL;
-- Operators list dead rows, oldest death first.
CREATE INDEX outbox_messages_dead ON outbox_messages (dead_at, id) WHERE dead_at IS NOT NULL;
