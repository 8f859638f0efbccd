-- A dead letter's failure group (16 hex digits over its reason, message type and
-- masked error), written with the letter, so the operator's filter and grouping read
-- an index instead of fingerprinting every letter. The masking is Rust's: letters
-- written before this column existed are filled by the store's migration step
-- (`WHERE failure_group IS NULL`, in bounded batches), not here.
ALTER TABLE inbox_dead_letters ADD COLUMN failure_group TEXT;
-- The filter by failure group, newest first, and the grouping.
CREATE INDEX inbox_dead_letters_failure_group
    ON inbox_dead_letters (failure_group, dead_lettered_at, id);
