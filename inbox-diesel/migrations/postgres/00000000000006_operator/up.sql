-- Operator tooling. A replay is an outbox row that keeps the original message key
-- (a new key would be a new claim, applied twice), so outbox rows are unique by
-- (key, replay sequence): 0 for the producer's own row, 1, 2, ... for replays.
ALTER TABLE outbox_messages ADD COLUMN replay_seq INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbox_messages DROP CONSTRAINT outbox_messages_message_key_key;
ALTER TABLE outbox_messages
    ADD CONSTRAINT outbox_messages_key_replay UNIQUE (message_key, replay_seq);

-- How often a dead letter was replayed, and when an operator discarded (archived) it:
-- a discarded letter is kept for its own retention, never replayed, listed apart.
ALTER TABLE inbox_dead_letters ADD COLUMN replay_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE inbox_dead_letters ADD COLUMN discarded_at TIMESTAMPTZ;

-- Operators list a group's letters newest first.
CREATE INDEX inbox_dead_letters_recent ON inbox_dead_letters (dead_lettered_at, id);
-- Stats and redrive read failed claims by due time.
CREATE INDEX inbox_claims_failed ON inbox_claims (next_attempt_at) WHERE status = 'failed';

-- `selftest`: the canary handler records each arrival of a canary message (it runs
-- under the claim like any handler, so a second arrival means a doubled effect).
CREATE TABLE inbox_canary (
    run_id      TEXT        NOT NULL,
    seq         INTEGER     NOT NULL,
    sent_at     TIMESTAMPTZ NOT NULL,
    arrived_at  TIMESTAMPTZ NOT NULL,
    arrivals    INTEGER     NOT NULL,
    PRIMARY KEY (run_id, seq)
);

-- A consumer group halted by a claim invariant violation (a `Stop`), until an operator
-- resumes it: the consumer writes the row when the group halts, starts the group
-- halted while the row exists, and resumes it once the row is gone.
CREATE TABLE inbox_group_halts (
    consumer_group  TEXT        NOT NULL PRIMARY KEY,
    message_key     TEXT        NOT NULL,
    detail          TEXT        NOT NULL,
    halted_at       TIMESTAMPTZ NOT NULL
);
