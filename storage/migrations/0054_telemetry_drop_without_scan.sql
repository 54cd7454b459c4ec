-- Dropping a day partition past the window held ingest off while it read the whole day
-- (docs/operations.md, "Telemetry partitions"). The rows received inside the window are
-- copied out after the DETACH, under its ACCESS EXCLUSIVE lock on telemetry, which every
-- ingest transaction waits for. PostgreSQL planned that copy as a sequential scan of the day
-- (a day never analysed), or read each block range the BRIN index on received_at had not
-- summarised (autovacuum summarises as it vacuums; an insert-only day's last part is never
-- vacuumed once the day is over): 0.6 s per million rows, at full rate seconds to tens of
-- seconds of ingest held, every day.
--
-- Now the day's BRIN ranges are summarised first, before the lock on telemetry is asked for
-- (that takes a SHARE UPDATE EXCLUSIVE lock on the day alone, which ingest does not wait for),
-- and the copy reads the index (no sequential scan): only the block ranges that hold rows
-- received inside the window are read under the lock.
CREATE OR REPLACE FUNCTION telemetry_drop_day_partition(day date, received_before timestamptz)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    name text := telemetry_partition_name(day);
    part regclass := to_regclass(telemetry_partition_name(day));
    brin regclass;
    seqscan text := current_setting('enable_seqscan');
BEGIN
    IF part IS NULL THEN
        RETURN false;
    END IF;
    SELECT i.indexrelid::regclass INTO brin
    FROM pg_index i JOIN pg_inherits h ON h.inhrelid = i.indexrelid
    WHERE i.indrelid = part AND h.inhparent = 'telemetry_received_at_brin'::regclass;
    IF brin IS NOT NULL THEN
        PERFORM brin_summarize_new_values(brin);
    END IF;
    EXECUTE format('ALTER TABLE telemetry DETACH PARTITION %I', name);
    PERFORM set_config('enable_seqscan', 'off', true);
    EXECUTE format('INSERT INTO telemetry SELECT * FROM %I WHERE received_at >= $1', name)
        USING received_before;
    PERFORM set_config('enable_seqscan', seqscan, true);
    EXECUTE format('DROP TABLE %I', name);
    RETURN true;
END
$$;
