DROP TABLE inbox_canary;
DROP INDEX inbox_claims_failed;
DROP INDEX inbox_dead_letters_recent;
ALTER TABLE inbox_dead_letters DROP COLUMN discarded_at;
ALTER TABLE inbox_dead_letters DROP COLUMN replay_count;
DELETE FROM outbox_messages WHERE replay_seq <> 0;
ALTER TABLE outbox_messages DROP CONSTRAINT outbox_messages_key_replay;
ALTER TABLE outbox_messages ADD CONSTRAINT outbox_messages_message_key_key UNIQUE (message_key);
ALTER TABLE outbox_messages DROP COLUMN replay_seq;
