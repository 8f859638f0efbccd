DROP TABLE inbox_rebuild_runs;
ALTER TABLE inbox_dead_letters DROP COLUMN resolved_at;
ALTER TABLE inbox_claims DROP COLUMN covered_at;
