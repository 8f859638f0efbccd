-- A body over the consumer's limit is never stored whole: its letter keeps the first
-- 4 KiB as `payload`, and the whole body's length and SHA-256 here. Both NULL: the
-- payload is the body as delivered.
ALTER TABLE inbox_dead_letters ADD COLUMN payload_length BIGINT;
ALTER TABLE inbox_dead_letters ADD COLUMN payload_sha256 BLOB;
