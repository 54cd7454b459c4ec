-- The same three checks, written without their long bounded repeats. PostgreSQL's regular
-- expressions expand `x{64}` into 64 copies of `x`, and matching one such pattern cost more
-- than the rest of inserting the row: `event_id ~ '^[0-9a-f]{64}$'` took about 9 µs of PostgreSQL's CPU a
-- row against 2-3 µs for `octet_length(event_id) = 64 AND event_id ~ '^[0-9a-f]+$'`, and a
-- telemetry row's insert went from about 27 to 17 µs when its check was the cheaper one
-- (docs/performance.md, "A check that cost more than the row"). Each new check refuses
-- exactly what the old one refused: the characters allowed are one byte each, so a length in
-- bytes is a length in characters; `$` ends the text (no trailing newline passes).

-- Telemetry: every partition holds the parent's check, inherited (attached partitions too:
-- ATTACH PARTITION makes their copy an inherited one), so dropping it at the parent drops
-- theirs, and the new check reaches each of them, the rows checked once. A test upgrades a
-- database with rows in several partitions and reads every partition's checks.
ALTER TABLE telemetry DROP CONSTRAINT telemetry_event_id_check;
ALTER TABLE telemetry ADD CONSTRAINT telemetry_event_id_check
    CHECK (octet_length(event_id) = 64 AND event_id ~ '^[0-9a-f]+$');

-- A dead letter's SHA-256, as hex.
ALTER TABLE dead_letter
    DROP CONSTRAINT dead_letter_payload_sha256_valid,
    ADD CONSTRAINT dead_letter_payload_sha256_valid
        CHECK (octet_length(payload_sha256) = 64 AND payload_sha256 ~ '^[0-9a-f]+$');

-- A command's device: one to three levels of 1-64 characters each (migration 0026). split_part
-- gives '' for a level that is not there.
ALTER TABLE command
    DROP CONSTRAINT command_device_id_valid,
    ADD CONSTRAINT command_device_id_valid
        CHECK (device_id ~ '^[A-Za-z0-9_.:-]+(/[A-Za-z0-9_.:-]+){0,2}$'
               AND octet_length(split_part(device_id, '/', 1)) <= 64
               AND octet_length(split_part(device_id, '/', 2)) <= 64
               AND octet_length(split_part(device_id, '/', 3)) <= 64);
