-- Late samples judged again from the stored samples of their run (gateway.domain.rules.runs):
-- read on the ingest transaction, under the rule state's row lock, only for a late sample the
-- state cannot place.

-- name: samples_before
-- $1 device id, $2 metric, $3 device time, $4 how many; the device's stored samples of the
-- metric at or before $3, newest first (device time, then seq): where the late sample's run
-- began. Reads telemetry_device_ts_idx.
SELECT ts, seq, event_id, (metrics -> $2)::text AS value
FROM telemetry
WHERE device_id = $1 AND ts <= $3 AND metrics ? $2
ORDER BY ts DESC, seq DESC NULLS LAST
LIMIT $4;

-- name: samples_from
-- $1 device id, $2 metric, $3 device time, $4 how many; the device's stored samples of the
-- metric from $3 on, oldest first: what the replay reads.
SELECT ts, seq, event_id, (metrics -> $2)::text AS value
FROM telemetry
WHERE device_id = $1 AND ts >= $3 AND metrics ? $2
ORDER BY ts, seq NULLS FIRST
LIMIT $4;

-- name: alarms_after
-- $1 device id, $2 rule key, $3 device time; the alarms of (device, rule) raised by a sample
-- dated after $3, oldest first: that sample's time (its trigger's `sample_ts`, which migration
-- 0036 gave to the alarms from before migration 0010 whose sample was still stored) and event
-- id. Reads alarm_device_idx.
SELECT raised.ts AS sample_ts, a.telemetry_event_id AS event_id
FROM alarm a
CROSS JOIN LATERAL (SELECT (a.trigger ->> 'sample_ts')::timestamptz AS ts) AS raised
WHERE a.device_id = $1 AND a.rule_key = $2 AND raised.ts > $3
ORDER BY raised.ts, a.id;

-- name: device_seqs
-- $1 device id, $2 device time, $3 how many; the seqs of the device's stored messages from $2
-- on, whatever they carried: where a message is missing between two samples of a metric.
SELECT seq FROM telemetry
WHERE device_id = $1 AND ts >= $2 AND seq IS NOT NULL
ORDER BY ts, seq
LIMIT $3;

-- name: newest_samples
-- $1 device ids, $2 metrics (pairwise); the newest stored sample (device time, then seq) of
-- each device's metric, answered with its position in $1 (from 1), none for a device with no
-- sample of it stored: what the hold timer judges a row whose rule a reload changed from
-- (AlarmEngine.rejudge_stale_rows), a page of rows in one statement. Reads
-- telemetry_device_ts_idx, as samples_before.
SELECT u.n::int4 AS n, t.ts, t.seq, t.event_id, (t.metrics -> u.m)::text AS value
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(d, m, n)
CROSS JOIN LATERAL (
    SELECT s.ts, s.seq, s.event_id, s.metrics
    FROM telemetry s
    WHERE s.device_id = u.d AND s.metrics ? u.m
    ORDER BY s.ts DESC, s.seq DESC NULLS LAST
    LIMIT 1
) t;
