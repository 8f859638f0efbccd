-- Claims: one row per (consumer group, message key). The primary key is the claim
-- key, and it is the only unique constraint on the table (verify_schema checks it).
-- Timestamps are RFC 3339 text in UTC, which sorts in time order.
CREATE TABLE inbox_claims (
    consumer_group   TEXT    NOT NULL,
    message_key      TEXT    NOT NULL,
    message_type     TEXT    NOT NULL,
    tenant           TEXT,
    payload_digest   BLOB    NOT NULL,
    status           TEXT    NOT NULL CHECK (status IN ('started', 'done', 'failed', 'dead')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    starts           INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  TEXT,
    last_error       TEXT,
    payload          BLOB,
    first_seen_at    TEXT    NOT NULL,
    updated_at       TEXT    NOT NULL,
    -- The claim key. message_key leads: it is the selective column (a group has
    -- millions of rows), so a plan cached while the table was small can never turn
    -- a lookup by key into a scan of the whole group.
    PRIMARY KEY (message_key, consumer_group)
) WITHOUT ROWID;

CREATE TABLE inbox_dead_letters (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer_group    TEXT    NOT NULL,
    message_key       TEXT    NOT NULL,
    message_type      TEXT    NOT NULL,
    tenant            TEXT,
    payload           BLOB    NOT NULL,
    headers           TEXT    NOT NULL,
    attempts          INTEGER NOT NULL,
    reason            TEXT    NOT NULL,
    last_error        TEXT,
    dead_lettered_at  TEXT    NOT NULL,
    replayed_at       TEXT
);

CREATE INDEX inbox_dead_letters_key ON inbox_dead_letters (consumer_group, message_key);
