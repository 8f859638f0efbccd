ALTER TABLE outbox_messages
    ALTER COLUMN message_key TYPE TEXT COLLATE "default",
    ALTER COLUMN ordering_key TYPE TEXT COLLATE "default";
ALTER TABLE inbox_dead_letters
    ALTER COLUMN consumer_group TYPE TEXT COLLATE "default",
    ALTER COLUMN message_key TYPE TEXT COLLATE "default";
ALTER TABLE inbox_claims
    ALTER COLUMN consumer_group TYPE TEXT COLLATE "default",
    ALTER COLUMN message_key TYPE TEXT COLLATE "default";
