-- The operator's activity counts: per consumer group, the claims that reached `done`
-- and the dead letters, newest first, as bounded index range reads. The groups
-- themselves are found by a loose index scan of the claims' primary key
-- (consumer_group, message_key) and of the second index below.
--
-- A store with millions of claims can create the first index beforehand with
-- `CREATE INDEX CONCURRENTLY inbox_claims_done_by_group ...` (same name, columns and
-- predicate): this migration then finds it and skips it.
CREATE INDEX IF NOT EXISTS inbox_claims_done_by_group
    ON inbox_claims (consumer_group, updated_at) WHERE status = 'done';
CREATE INDEX IF NOT EXISTS inbox_dead_letters_by_group
    ON inbox_dead_letters (consumer_group, dead_lettered_at);
