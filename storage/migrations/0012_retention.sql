-- Retention (bounded disk). Telemetry becomes a table partitioned by day (RANGE on
-- ts, UTC days), so that a day older than [retention] telemetry_days goes with one DROP TABLE
-- instead of a DELETE of millions of rows. The other tables are pruned in bounded batches by
-- the maintenance loop (gateway/maintenance); this migration only gives those batches the
-- columns and indexes they need.
--
-- Exactly once. A partitioned table's unique keys must hold the partition key, so the primary
-- key becomes (event_id, ts). That is no weaker than event_id alone: the event id hashes the
-- device id and the decoded message, ts included (protocol/eventid.py), so one event id always
-- comes with one ts, every copy of an event lands in the same partition, and the partition's
-- unique index refuses the second one. Ingest says ON CONFLICT (event_id, ts) DO NOTHING.
--
-- A sample whose day has no partition (a device clock far off, a day before the partitions
-- were made, a day already dropped) goes to telemetry_default, which has the same unique key:
-- stored exactly once there too. telemetry_add_day_partition moves the rows of that day out of
-- the default partition into the new one, under a lock that holds writers off meanwhile.

-- The table as it was: renamed (with its indexes, whose names are schema-wide), copied, dropped.
ALTER TABLE telemetry RENAME TO telemetry_unpartitioned;
ALTER INDEX telemetry_pkey RENAME TO telemetry_unpartitioned_pkey;
ALTER INDEX telemetry_device_ts_idx RENAME TO telemetry_unpartitioned_device_ts_idx;

CREATE TABLE telemetry (
    event_id     text NOT NULL CONSTRAINT telemetry_event_id_check
                 CHECK (event_id ~ '^[0-9a-f]{64}$'),
    device_id    text NOT NULL,
    ts           timestamptz NOT NULL,
    seq          bigint,
    metrics      jsonb,
    events       jsonb,
    received_at  timestamptz NOT NULL DEFAULT now(),
    node_id      text NOT NULL
) PARTITION BY RANGE (ts);

CREATE TABLE telemetry_default PARTITION OF telemetry DEFAULT;

-- The name of a day's partition: telemetry_pYYYYMMDD (a UTC day).
CREATE FUNCTION telemetry_partition_name(day date) RETURNS text
LANGUAGE sql IMMUTABLE AS $$ SELECT 'telemetry_p' || to_char(day, 'YYYYMMDD') $$;

-- Creates the partition of one UTC day unless it exists; true when it made it. Rows of that
-- day in the default partition move into it, in the same transaction. SHARE ROW EXCLUSIVE on
-- telemetry waits for the ingest transactions in flight and holds new ones off until commit
-- (reads go on): no row of the day can reach the default partition between the move and the
-- attach, and an insert waiting meanwhile is routed by the new partition bounds once it runs.
-- The caller sets lock_timeout, so that a long reader cannot queue ingest behind this.
CREATE FUNCTION telemetry_add_day_partition(day date) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    name text := telemetry_partition_name(day);
    low timestamptz := day::timestamp AT TIME ZONE 'UTC';
    high timestamptz := (day + 1)::timestamp AT TIME ZONE 'UTC';
BEGIN
    IF to_regclass(name) IS NOT NULL THEN
        RETURN false;
    END IF;
    LOCK TABLE telemetry IN SHARE ROW EXCLUSIVE MODE;
    IF to_regclass(name) IS NOT NULL THEN  -- made by another transaction while this one waited
        RETURN false;
    END IF;
    EXECUTE format('CREATE TABLE %I (LIKE telemetry INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                   name);
    EXECUTE format('WITH moved AS (DELETE FROM telemetry_default WHERE ts >= $1 AND ts < $2 '
                   'RETURNING *) INSERT INTO %I SELECT * FROM moved', name)
        USING low, high;
    -- Builds the partition's copies of telemetry's indexes (the moved rows only).
    EXECUTE format('ALTER TABLE telemetry ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                   name, low, high);
    RETURN true;
END
$$;

-- Drops the partition of one UTC day if it exists; true when it did.
CREATE FUNCTION telemetry_drop_day_partition(day date) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    name text := telemetry_partition_name(day);
BEGIN
    IF to_regclass(name) IS NULL THEN
        RETURN false;
    END IF;
    EXECUTE format('DROP TABLE %I', name);
    RETURN true;
END
$$;

-- The oldest UTC day that holds telemetry (NULL when none does): the default partition's
-- oldest row, or the oldest day partition holding any row, whichever is older.
CREATE FUNCTION telemetry_oldest_day() RETURNS date
LANGUAGE plpgsql STABLE AS $$
DECLARE
    part record;
    oldest date;
    present boolean;
BEGIN
    SELECT min(ts AT TIME ZONE 'UTC')::date INTO oldest FROM telemetry_default;
    FOR part IN
        SELECT c.relname, to_date(substr(c.relname, 12), 'YYYYMMDD') AS day
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'telemetry'::regclass AND c.relname ~ '^telemetry_p[0-9]{8}$'
        ORDER BY 2
    LOOP
        EXIT WHEN oldest IS NOT NULL AND part.day >= oldest;
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I)', part.relname) INTO present;
        IF present THEN
            RETURN part.day;
        END IF;
    END LOOP;
    RETURN oldest;
END
$$;

-- A partition for every day of the last year that holds rows, and for today and the week
-- ahead (the maintenance loop keeps [retention] partitions_ahead_days ahead from then on).
-- Rows of other days go to the default partition; the loop deletes those older than the
-- window in batches. The partitions are made before the copy and before the indexes: the
-- copy then only routes rows, and each index is built once, in bulk, by the ALTER below.
SELECT telemetry_add_day_partition(day)
FROM (
    SELECT DISTINCT (ts AT TIME ZONE 'UTC')::date AS day
    FROM telemetry_unpartitioned
    WHERE ts >= ((now() AT TIME ZONE 'UTC')::date - 366)::timestamp AT TIME ZONE 'UTC'
      AND ts < ((now() AT TIME ZONE 'UTC')::date + 8)::timestamp AT TIME ZONE 'UTC'
    UNION
    SELECT (now() AT TIME ZONE 'UTC')::date + n FROM generate_series(0, 7) AS n
) AS days
ORDER BY day;

INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, events, received_at, node_id)
SELECT event_id, device_id, ts, seq, metrics, events, received_at, node_id
FROM telemetry_unpartitioned;

DROP TABLE telemetry_unpartitioned;

ALTER TABLE telemetry ADD CONSTRAINT telemetry_pkey PRIMARY KEY (event_id, ts);
CREATE INDEX telemetry_device_ts_idx ON telemetry (device_id, ts DESC);

-- AI payloads: once [retention] ai_payload_days have passed since a task finished, the bulky
-- request_payload (the prompt with its telemetry) and raw_response (the model's answer) are
-- cleared and payload_pruned_at says when. The task and its summary, cause, suggestion, risk,
-- confidence and error stay (the API shows them). The checks that asked for the payloads on a
-- finished task hold until then.
ALTER TABLE ai_task ADD COLUMN payload_pruned_at timestamptz;

ALTER TABLE ai_task
    DROP CONSTRAINT ai_task_succeeded_has_result,
    ADD CONSTRAINT ai_task_succeeded_has_result CHECK (
        status <> 'SUCCEEDED'
        OR (summary IS NOT NULL AND possible_cause IS NOT NULL
            AND inspection_suggestion IS NOT NULL AND risk_level IS NOT NULL
            AND confidence IS NOT NULL
            AND started_at IS NOT NULL AND finished_at IS NOT NULL
            AND (payload_pruned_at IS NOT NULL
                 OR (request_payload IS NOT NULL
                     AND raw_response IS NOT NULL AND raw_response ~ '\S')))
    ),
    DROP CONSTRAINT ai_task_failed_has_error,
    ADD CONSTRAINT ai_task_failed_has_error CHECK (
        status <> 'FAILED'
        OR (error_code IS NOT NULL AND error_message IS NOT NULL AND finished_at IS NOT NULL
            AND (payload_pruned_at IS NOT NULL OR request_payload IS NOT NULL))
    ),
    DROP CONSTRAINT ai_task_output_invalid_keeps_raw,
    ADD CONSTRAINT ai_task_output_invalid_keeps_raw CHECK (
        error_code IS DISTINCT FROM 'LLM_OUTPUT_INVALID'
        OR raw_response IS NOT NULL
        OR payload_pruned_at IS NOT NULL
    ),
    ADD CONSTRAINT ai_task_pruned_when_finished CHECK (
        payload_pruned_at IS NULL
        OR (status IN ('SUCCEEDED', 'FAILED') AND request_payload IS NULL
            AND raw_response IS NULL)
    );

-- The tasks whose payloads are still there, in id order (the pruning walks them).
CREATE INDEX ai_task_payload_kept_idx ON ai_task (id) WHERE payload_pruned_at IS NULL;

-- consumed_event has no id to walk in time order: prune it by consumed_at.
CREATE INDEX consumed_event_consumed_at_idx ON consumed_event (consumed_at);
