-- The credit ledger of refund-then-reclaim: jobs with their guard flags, and an
-- append-only ledger whose sum per user is the balance.
CREATE TABLE jobs (
    job_id       TEXT        PRIMARY KEY CHECK (length(job_id) BETWEEN 1 AND 255),
    user_id      TEXT        NOT NULL CHECK (length(user_id) BETWEEN 1 AND 255),
    cost         BIGINT      NOT NULL CHECK (cost > 0),
    state        TEXT        NOT NULL
                 CHECK (state IN ('queued', 'running', 'delivered', 'failed', 'dead')),
    attempts     INTEGER     NOT NULL CHECK (attempts >= 1),
    refunded     BOOLEAN     NOT NULL DEFAULT FALSE,
    reclaimed    BOOLEAN     NOT NULL DEFAULT FALSE,
    last_error   TEXT,
    created_at   TIMESTAMPTZ NOT NULL,
    updated_at   TIMESTAMPTZ NOT NULL,
    refunded_at  TIMESTAMPTZ,
    reclaimed_at TIMESTAMPTZ,
    delivered_at TIMESTAMPTZ,
    -- A reclaim takes back a refund of a job that was delivered after all.
    CHECK (NOT reclaimed OR (refunded AND state = 'delivered'))
);

CREATE TABLE credit_ledger (
    id         BIGSERIAL   PRIMARY KEY,
    job_id     TEXT        NOT NULL REFERENCES jobs (job_id),
    entry_type TEXT        NOT NULL CHECK (entry_type IN ('charge', 'refund', 'reclaim')),
    amount     BIGINT      NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    -- A refund gives credits back; a charge and a reclaim take them.
    CHECK ((entry_type = 'refund') = (amount > 0) AND amount <> 0),
    -- The fact behind the guards: one charge, one refund, one reclaim per job at most.
    UNIQUE (job_id, entry_type)
);

CREATE FUNCTION credit_ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'credit_ledger is append-only: % refused', TG_OP
        USING ERRCODE = 'restrict_violation';
END
$$;

CREATE TRIGGER credit_ledger_append_only BEFORE UPDATE OR DELETE ON credit_ledger
    FOR EACH ROW EXECUTE FUNCTION credit_ledger_append_only();
