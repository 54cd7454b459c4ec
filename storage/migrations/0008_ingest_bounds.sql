-- Dead letters bounded in bytes, and one per repeated message.
--
-- payload keeps at most [ingest] dead_letter_max_bytes of what arrived (a 10 MB payload no
-- longer puts 10 MB into the table); payload_size and payload_sha256 describe the whole of it.
-- A letter with payload_size > octet_length(payload) was truncated and cannot be replayed.
--
-- The same bytes on the same topic make one pending (not yet replayed) letter: a retained
-- invalid message, dead-lettered again at every restart, counts seen_count up and moves
-- last_seen_at instead of adding a row. Once replayed, a letter leaves that key, and the same
-- bytes arriving again make a new letter.

ALTER TABLE dead_letter
    ADD COLUMN payload_size bigint,
    ADD COLUMN payload_sha256 text,
    ADD COLUMN seen_count integer NOT NULL DEFAULT 1,
    ADD COLUMN last_seen_at timestamptz;

UPDATE dead_letter
SET payload_size = octet_length(payload),
    payload_sha256 = encode(sha256(payload), 'hex'),
    last_seen_at = received_at;

-- Pending duplicates written before this migration fold into their oldest letter, which
-- takes their count and latest time (they are the same bytes on the same topic).
CREATE TEMPORARY TABLE dead_letter_fold ON COMMIT DROP AS
SELECT id,
       first_value(id) OVER same AS keeper,
       count(*) OVER same AS seen,
       max(received_at) OVER same AS last_seen
FROM dead_letter
WHERE replayed_at IS NULL
WINDOW same AS (PARTITION BY topic, payload_sha256 ORDER BY id
                ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING);

UPDATE dead_letter d
SET seen_count = f.seen, last_seen_at = f.last_seen
FROM dead_letter_fold f
WHERE d.id = f.id AND f.id = f.keeper AND f.seen > 1;

DELETE FROM dead_letter d
USING dead_letter_fold f
WHERE d.id = f.id AND f.id <> f.keeper;

ALTER TABLE dead_letter
    ALTER COLUMN payload_size SET NOT NULL,
    ALTER COLUMN payload_sha256 SET NOT NULL,
    ALTER COLUMN last_seen_at SET NOT NULL,
    ALTER COLUMN last_seen_at SET DEFAULT now(),
    ADD CONSTRAINT dead_letter_payload_size_valid CHECK (payload_size >= octet_length(payload)),
    ADD CONSTRAINT dead_letter_payload_sha256_valid CHECK (payload_sha256 ~ '^[0-9a-f]{64}$'),
    ADD CONSTRAINT dead_letter_seen_count_valid CHECK (seen_count >= 1);

CREATE UNIQUE INDEX dead_letter_pending_key ON dead_letter (topic, payload_sha256)
    WHERE replayed_at IS NULL;
