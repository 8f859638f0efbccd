DROP INDEX inbox_claims_done;
DROP TABLE outbox_messages;
