-- Keys are opaque identifiers: compare them byte by byte. Under the database's
-- default collation (C.UTF-8 or a language) every B-tree comparison of a key goes
-- through strcoll on copied buffers; "C" is a memcmp. It also makes the index order
-- the byte order in which the store sorts a batch's claims.
ALTER TABLE inbox_claims
    ALTER COLUMN consumer_group TYPE TEXT COLLATE "C",
    ALTER COLUMN message_key TYPE TEXT COLLATE "C";
ALTER TABLE inbox_dead_letters
    ALTER COLUMN consumer_group TYPE TEXT COLLATE "C",
    ALTER COLUMN message_key TYPE TEXT COLLATE "C";
ALTER TABLE outbox_messages
    ALTER COLUMN message_key TYPE TEXT COLLATE "C",
    ALTER COLUMN ordering_key TYPE TEXT COLLATE "C";
