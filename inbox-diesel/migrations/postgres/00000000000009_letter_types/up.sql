-- Dead letters 0.1.0 stored under a queue's name instead of their message type.
-- 0.1.0 read the type of a message published without a `type` property from its
-- routing key, and once the broker has dead-lettered a message (out of a retry tier,
-- or into `<group>:dlq` at the delivery limit) its routing key is the next queue's
-- name: the retry of such a message found no handler (`no_handler`), and the broker's
-- give-up was recorded under `<group>:dlq` (`delivery_limit`). Replayed as stored,
-- either would find no handler again. The claim of the same key recorded the type
-- of the message's first delivery, its real one: the letter takes it.
-- Only letters the broker dead-lettered on their way (an `x-first-death-queue`
-- header), of those two reasons, not replayed yet, whose claim says otherwise.
UPDATE inbox_dead_letters
SET message_type = (
    SELECT c.message_type FROM inbox_claims c
    WHERE c.consumer_group = inbox_dead_letters.consumer_group
      AND c.message_key = inbox_dead_letters.message_key)
WHERE reason IN ('no_handler', 'delivery_limit')
  AND replayed_at IS NULL
  AND headers LIKE '%"x-first-death-queue":%'
  AND EXISTS (
    SELECT 1 FROM inbox_claims c
    WHERE c.consumer_group = inbox_dead_letters.consumer_group
      AND c.message_key = inbox_dead_letters.message_key
      AND c.message_type <> inbox_dead_letters.message_type);
