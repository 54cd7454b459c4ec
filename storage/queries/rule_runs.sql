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
-- $1 device id, $2 metric, $3 device time, $4 how many, $5 seconds (the device clock's
-- max_future_skew_s); the device's stored samples of the metric from $3 on, in device time
-- order (then seq): what the replay reads. A sample dated more than $5 ahead of its batch's
-- time (received_at, the receipt the rules judged it against) comes with that receipt as its
-- time: it was judged there, and its device time (a clock hours ahead) would place it after
-- every later sample (storage.rule_runs.samples_from puts it in its place; one placed before
-- $3 is left out). Reads telemetry_device_ts_idx in order, as before.
SELECT CASE WHEN ts > received_at + make_interval(secs => $5) THEN received_at ELSE ts END
           AS ts,
       seq, event_id, (metrics -> $2)::text AS value
FROM telemetry
WHERE device_id = $1 AND ts >= $3 AND metrics ? $2
ORDER BY telemetry.ts, seq NULLS FIRST
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
-- $1 device ids, $2 metrics, $3 device times, $4 seqs (pairwise: per row judged, the device
-- time and seq of the newest sample the row judged, its last_device_ts else last_ts, and
-- last_seq); the newest stored sample of each device's metric, answered with its position in
-- $1 (from 1), none for a device with no sample of it stored: what the hold timer judges a row
-- whose rule a reload changed from (AlarmEngine.rejudge_stale_rows), a page of rows in one
-- statement. The newest is the row's own newest sample where it holds the metric: on the
-- row's timeline, no sample is newer (a sample dated ahead of its receipt, or a clock stepped
-- back, is not newest by device time); else (the metric changed, the sample is gone) the
-- newest by device time, then seq. Reads telemetry_device_ts_idx, as samples_before.
SELECT u.n::int4 AS n, t.ts, t.seq, t.event_id, (t.metrics -> u.m)::text AS value
FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::int8[])
    WITH ORDINALITY AS u(d, m, at, sq, n)
CROSS JOIN LATERAL (
    SELECT c.ts, c.seq, c.event_id, c.metrics
    FROM (
        (SELECT s.ts, s.seq, s.event_id, s.metrics, 0 AS rank
         FROM telemetry s
         WHERE s.device_id = u.d AND s.ts = u.at AND s.seq IS NOT DISTINCT FROM u.sq
           AND s.metrics ? u.m
         ORDER BY s.received_at DESC
         LIMIT 1)
        UNION ALL
        (SELECT s.ts, s.seq, s.event_id, s.metrics, 1 AS rank
         FROM telemetry s
         WHERE s.device_id = u.d AND s.metrics ? u.m
         ORDER BY s.ts DESC, s.seq DESC NULLS LAST
         LIMIT 1)
    ) c
    ORDER BY c.rank
    LIMIT 1
) t;
