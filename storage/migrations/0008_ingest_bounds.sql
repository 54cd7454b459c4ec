-- Dead letters bounded in bytes.
--
-- payload keeps at most [ingest] dead_letter_max_bytes of what arrived (a 10 MB payload no
-- longer puts 10 MB into the table); payload_size and payload_sha256 describe the whole of it.
-- A letter with payload_size > octet_length(payload) was truncated and cannot be replayed.

ALTER TABLE dead_letter
    ADD COLUMN payload_size bigint,
    ADD COLUMN payload_sha256 text;

UPDATE dead_letter
SET payload_size = octet_length(payload),
    payload_sha256 = encode(sha256(payload), 'hex');

ALTER TABLE dead_letter
    ALTER COLUMN payload_size SET NOT NULL,
    ALTER COLUMN payload_sha256 SET NOT NULL,
    ADD CONSTRAINT dead_letter_payload_size_valid CHECK (payload_size >= octet_length(payload)),
    ADD CONSTRAINT dead_letter_payload_sha256_valid CHECK (payload_sha256 ~ '^[0-9a-f]{64}$');
