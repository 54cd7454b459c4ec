-- A dead letter's topic may be as long as MQTT allows (65,535 bytes: the `+` of
-- {prefix}/devices/+/telemetry matches a level of any length), and a btree entry may not
-- (8,191 bytes compressed, 2,704 for the tree): the pending letters' unique key on the topic
-- itself refused the letter of such a message ("index row requires 20104 bytes"), its batch was
-- retried for ever ("batch_refusal_unexplained": only the dead letter itself was refused), and
-- every message delivered after it, of every device, waited unacknowledged. The key is on the
-- topic's MD5 instead (32 bytes whatever the topic); the topic is kept whole in its column.
-- Two pending letters of the same payload on topics of the same MD5 (made so on purpose) would
-- count as one letter seen twice: nothing is lost that a dead letter holds but the second
-- topic.
DROP INDEX dead_letter_pending_key;
CREATE UNIQUE INDEX dead_letter_pending_key ON dead_letter (md5(topic), payload_sha256)
    WHERE replayed_at IS NULL;
