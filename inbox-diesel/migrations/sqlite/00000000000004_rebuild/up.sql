-- A claim a projection rebuild recorded or took over because the rebuilt rows count
-- its event: covered_at says when (RFC 3339 text, UTC). Its payload_digest is empty
-- (a rebuild reads the ledger, never the payload), so a later delivery of the event
-- is a duplicate, not a key collision, and a replay (guarded by the digest) cannot
-- take it.
ALTER TABLE inbox_claims ADD COLUMN covered_at TEXT;

-- A dead letter whose event a rebuild counted: resolved, so a replay refuses it.
ALTER TABLE inbox_dead_letters ADD COLUMN resolved_at TEXT;

-- One scheduled rebuild runner per projection at a time: the lease and its holder.
CREATE TABLE inbox_rebuild_runs (
    projection    TEXT NOT NULL PRIMARY KEY,
    runner        TEXT NOT NULL,
    leased_until  TEXT NOT NULL
);
