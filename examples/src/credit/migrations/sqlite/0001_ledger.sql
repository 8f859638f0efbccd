-- The credit ledger of refund-then-reclaim (SQLite mirror of the PostgreSQL schema).
CREATE TABLE jobs (
    job_id       TEXT    PRIMARY KEY NOT NULL CHECK (length(job_id) BETWEEN 1 AND 255),
    user_id      TEXT    NOT NULL CHECK (length(user_id) BETWEEN 1 AND 255),
    cost         INTEGER NOT NULL CHECK (typeof(cost) = 'integer' AND cost > 0),
    state        TEXT    NOT NULL
                 CHECK (state IN ('queued', 'running', 'delivered', 'failed', 'dead')),
    attempts     INTEGER NOT NULL CHECK (attempts >= 1),
    refunded     BOOLEAN NOT NULL DEFAULT FALSE CHECK (refunded IN (0, 1)),
    reclaimed    BOOLEAN NOT NULL DEFAULT FALSE CHECK (reclaimed IN (0, 1)),
    last_error   TEXT,
    created_at   TEXT    NOT NULL,
    updated_at   TEXT    NOT NULL,
    refunded_at  TEXT,
    reclaimed_at TEXT,
    delivered_at TEXT,
    CHECK (NOT reclaimed OR (refunded AND state = 'delivered'))
);

CREATE TABLE credit_ledger (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id     TEXT    NOT NULL REFERENCES jobs (job_id),
    entry_type TEXT    NOT NULL CHECK (entry_type IN ('charge', 'refund', 'reclaim')),
    amount     INTEGER NOT NULL CHECK (typeof(amount) = 'integer'),
    created_at TEXT    NOT NULL,
    CHECK ((entry_type = 'refund') = (amount > 0) AND amount <> 0),
    UNIQUE (job_id, entry_type)
);

CREATE TRIGGER credit_ledger_no_update BEFORE UPDATE ON credit_ledger
BEGIN
    SELECT RAISE(ABORT, 'credit_ledger is append-only: UPDATE refused');
END;

CREATE TRIGGER credit_ledger_no_delete BEFORE DELETE ON credit_ledger
BEGIN
    SELECT RAISE(ABORT, 'credit_ledger is append-only: DELETE refused');
END;
