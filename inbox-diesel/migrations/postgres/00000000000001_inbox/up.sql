-- Claims: one row per (consumer group, message key). The primary key is the claim
-- key, and it is the only unique constraint on the table (verify_schema checks it).
CREATE TABLE inbox_claims (
    consumer_group   TEXT        NOT NULL,
    message_key      TEXT        NOT NULL,
    message_type     TEXT        NOT NULL,
    tenant           TEXT,
    payload_digest   BYTEA       NOT NULL,
    status           TEXT        NOT NULL CHECK (status IN ('started', 'done', 'failed', 'dead')),
    attempts         INTEGER     NOT NULL DEFAULT 0,
    starts           INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at  TIMESTAMPTZ,
    last_error       TEXT,
    payload          BYTEA,
    first_seen_at    TIMESTAMPTZ NOT NULL,
    updated_at       TIMESTAMPTZ NOT NULL,
    -- The claim key. message_key leads: it is the selective column (a group has
    -- millions of rows), so a plan cached while the table was small can never turn
    -- a lookup by key into a scan of the whole group.
    PRIMARY KEY (message_key, consumer_group)
);

-- A surrogate id: a key collision dead-letters the newcomer under the same key.
CREATE TABLE inbox_dead_letters (
    id                BIGSERIAL   PRIMARY KEY,
    consumer_group    TEXT        NOT NULL,
    message_key       TEXT        NOT NULL,
    message_type      TEXT        NOT NULL,
    tenant            TEXT,
    payload           BYTEA       NOT NULL,
    headers           TEXT        NOT NULL,
    attempts          INTEGER     NOT NULL,
    reason            TEXT        NOT NULL,
    last_error        TEXT,
    dead_lettered_at  TIMESTAMPTZ NOT NULL,
    replayed_at       TIMESTAMPTZ
);

CREATE INDEX inbox_dead_letters_key ON inbox_dead_letters (consumer_group, message_key);
