-- What each projection rebuild and audit did, recorded when it finishes (ok or
-- failed) in a short transaction of its own, for operators (`inbox rebuild-reports`,
-- the operator API). Bounded: recording a report deletes its projection's reports
-- beyond the newest 100. Created whatever features a build has: the standalone CLI
-- reads it without the rebuild hooks.
CREATE TABLE inbox_rebuild_reports (
    id             INTEGER     PRIMARY KEY AUTOINCREMENT,
    projection     TEXT        NOT NULL,
    kind           TEXT        NOT NULL CHECK (kind IN ('rebuild', 'audit')),
    started_at     TEXT        NOT NULL,
    finished_at    TEXT        NOT NULL,
    outcome        TEXT        NOT NULL CHECK (outcome IN ('ok', 'failed')),
    -- A failed run's error and its causes, at most 2,000 characters.
    error          TEXT,
    partitions             BIGINT NOT NULL,
    rows_checked           BIGINT NOT NULL,
    rows_differing         BIGINT NOT NULL,
    rows_changed           BIGINT NOT NULL,
    extra_rows             BIGINT NOT NULL,
    events_covered         BIGINT NOT NULL,
    claims_recorded        BIGINT NOT NULL,
    claims_converted       BIGINT NOT NULL,
    dead_letters_resolved  BIGINT NOT NULL,
    largest_ratio          REAL,
    lock_waits             BIGINT NOT NULL,
    lock_timeouts          BIGINT NOT NULL,
    duration_ms            BIGINT NOT NULL,
    -- The report's sample of differing rows, as JSON (an array of
    -- {partition, row, projected, recomputed}).
    drift_sample           TEXT   NOT NULL
);
-- A projection's newest reports first, and the trim of its oldest.
CREATE INDEX inbox_rebuild_reports_recent ON inbox_rebuild_reports (projection, id);
