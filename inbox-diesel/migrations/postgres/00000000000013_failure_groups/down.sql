DROP INDEX inbox_dead_letters_failure_group;
ALTER TABLE inbox_dead_letters DROP COLUMN failure_group;
