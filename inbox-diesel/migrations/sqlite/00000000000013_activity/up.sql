-- The operator's activity counts: per consumer group, the claims that reached `done`
-- and the dead letters, newest first, as bounded index range reads. SQLite's claim
-- key is (message_key, consumer_group), so the first index also finds the groups
-- (a loose index scan on its first column), which a partial index could not for
-- groups with no done claim.
CREATE INDEX inbox_claims_done_by_group
    ON inbox_claims (consumer_group, status, updated_at);
CREATE INDEX inbox_dead_letters_by_group
    ON inbox_dead_letters (consumer_group, dead_lettered_at);
