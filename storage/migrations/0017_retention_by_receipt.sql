-- Retention never drops a sample sooner than [retention] telemetry_days after it was received,
-- whatever its device timestamp says. Day partitions go by the samples' own timestamps, so a
-- device whose clock is months behind, or that uploads a store-and-forward buffer, had its
-- fresh samples dropped with an old day's partition at the next maintenance pass.
--
-- A day partition past the window is now detached first; the rows in it received within the
-- window go back into telemetry (to the default partition: their day has no partition any
-- more), and the rest is dropped with it. The default partition is pruned by receipt time.
-- A BRIN index on received_at finds those rows without reading an old partition whole: rows
-- are appended in receipt order, so each block range's summary is tight, and a partition
-- whose rows were all received long ago is passed over on its summaries alone.

CREATE INDEX telemetry_received_at_brin ON telemetry USING brin (received_at);

DROP FUNCTION telemetry_drop_day_partition(date);

-- Drops the partition of one UTC day if it exists, keeping (in the default partition) its
-- rows received at or after received_before; true when it dropped one.
CREATE FUNCTION telemetry_drop_day_partition(day date, received_before timestamptz)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    name text := telemetry_partition_name(day);
BEGIN
    IF to_regclass(name) IS NULL THEN
        RETURN false;
    END IF;
    EXECUTE format('ALTER TABLE telemetry DETACH PARTITION %I', name);
    EXECUTE format('INSERT INTO telemetry SELECT * FROM %I WHERE received_at >= $1', name)
        USING received_before;
    EXECUTE format('DROP TABLE %I', name);
    RETURN true;
END
$$;
