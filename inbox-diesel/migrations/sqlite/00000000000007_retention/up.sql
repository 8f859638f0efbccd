-- Retention deletes discarded dead letters oldest discard first, in bounded batches:
-- each batch reads its rows from this index instead of scanning every letter.
CREATE INDEX inbox_dead_letters_discarded ON inbox_dead_letters (discarded_at)
    WHERE discarded_at IS NOT NULL;
