-- Fencing tokens of idempotency leases become 16 random bytes. A counter restarts
-- at 1 whenever a key's record is deleted and begun again (abandoned, purged, or
-- rolled back together with its sequence by a failover), so a stalled request's
-- late commit could land on another request's record; a random token names one
-- lease of one record and never repeats.
-- Every row gets a fresh random token: no process holds a 16-byte token of a row
-- written before, so a request in flight across the upgrade is fenced off (its
-- commit fails, it rolls back; a retry with the key waits for the lease and takes
-- it over), and settled rows keep their meaning (replays read the status and the
-- saved response, not the token).
ALTER TABLE idempotency_keys
    ALTER COLUMN lease_token TYPE BYTEA USING uuid_send(gen_random_uuid());
ALTER TABLE idempotency_keys
    ADD CONSTRAINT idempotency_keys_lease_token_len CHECK (octet_length(lease_token) = 16);
