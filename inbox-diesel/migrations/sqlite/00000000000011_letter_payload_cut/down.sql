ALTER TABLE inbox_dead_letters DROP COLUMN payload_sha256;
ALTER TABLE inbox_dead_letters DROP COLUMN payload_length;
