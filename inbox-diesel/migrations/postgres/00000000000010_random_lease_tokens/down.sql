-- Back to the counter: every row's token restarts at 1 (the random tokens have no
-- counter value), which fences off any request in flight, as the upgrade did.
ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_lease_token_len;
ALTER TABLE idempotency_keys ALTER COLUMN lease_token TYPE BIGINT USING 1;
