-- Telemetry's key leads with the sample's time: (ts, event_id) instead of (event_id, ts).
--
-- The event id is a SHA-256 in hex, so under the old key every insert landed on a random leaf
-- of an index that grows with the table. Once that index outgrows shared_buffers, each insert
-- reads a leaf from disk or the OS cache, and after each checkpoint the first change to each
-- leaf writes the whole 8 KB page to the WAL. Measured on a day's partition of 1.5 million
-- rows (docs/performance.md, "Telemetry's key by time"): 80,000 inserts in batches of 500
-- after a checkpoint wrote about 24,000 full-page images and 156 MB of WAL under the old key,
-- against 9 and 44.5 MB under the new one, for half of PostgreSQL's CPU a row (16.5 against
-- 8.2 µs). Samples arrive about in time order, so under the new key they land on the newest
-- leaves, which stay in memory.
--
-- Exactly once is unchanged: the unique key is the same pair of columns (ingest's ON CONFLICT
-- (event_id, ts) names the columns, not their order), and it still holds the partition key.
--
-- The one lookup by event id alone: an alarm raised before migration 0010 keeps no sample_ts
-- in its trigger, and the late-clear and alarms_after queries looked its sample up in
-- telemetry. Without an index leading with the event id that lookup would read every
-- partition whole, so it is done here, once, while the old key serves it: such an alarm whose
-- sample is still stored gets the sample's time as its trigger's sample_ts (a trigger of its
-- own, since those alarms have none), and the queries read only the trigger from now on. An
-- alarm whose sample is gone gets none, as the lookup found none. Each alarm without one looks
-- its sample up by the old key's leading column (one probe per partition), never by a join
-- that could read the whole table.
UPDATE alarm a
SET trigger = coalesce(a.trigger, '{}'::jsonb)
              || jsonb_build_object('sample_ts',
                                    to_char(sample.ts AT TIME ZONE 'UTC',
                                            'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))
FROM (
    SELECT b.id, (SELECT t.ts FROM telemetry t WHERE t.event_id = b.telemetry_event_id LIMIT 1)
                 AS ts
    FROM alarm b
    WHERE (b.trigger ->> 'sample_ts') IS NULL
) AS sample
WHERE a.id = sample.id AND sample.ts IS NOT NULL;

-- Every partition's index is rebuilt (the default partition's and each day's), inside the
-- migration's transaction: ingest waits meanwhile (docs/operations.md, "Upgrading an
-- installation", gives the time per million rows).
ALTER TABLE telemetry DROP CONSTRAINT telemetry_pkey;
ALTER TABLE telemetry ADD CONSTRAINT telemetry_pkey PRIMARY KEY (ts, event_id);
