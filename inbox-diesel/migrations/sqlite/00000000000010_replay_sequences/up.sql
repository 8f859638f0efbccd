-- A replay's sequence per message key, counted on a row of its own that no purge
-- deletes: `max(replay_seq) + 1` over the outbox restarted at 1 once the published
-- rows of earlier replays were purged, and a key's second replay reused a sequence.
CREATE TABLE inbox_replay_sequences (
    message_key TEXT    NOT NULL PRIMARY KEY,
    last_seq    INTEGER NOT NULL CHECK (last_seq > 0)
);
-- The replays the outbox still holds: the counter goes on from the highest.
INSERT INTO inbox_replay_sequences (message_key, last_seq)
SELECT message_key, max(replay_seq) FROM outbox_messages
WHERE replay_seq > 0
GROUP BY message_key;
