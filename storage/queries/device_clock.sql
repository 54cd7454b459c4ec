-- name: record_adjustments
-- $1 device ids, $2 reasons, $3 counts, $4 received at, $5 device ts, $6 judged ts (arrays,
-- pairwise, one entry per (device, reason), sorted by device then reason: every node writes
-- in this one order, so two batches wait, never deadlock). Adds the counts; the last
-- adjustment is replaced only by one received no earlier (a batch that committed late never
-- hides a newer one).
INSERT INTO device_clock AS c (device_id, reason, count, last_received_at, last_device_ts,
                               last_judged_ts)
SELECT d, r, n, rec, dev, jud
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::timestamptz[], $5::timestamptz[],
            $6::timestamptz[]) WITH ORDINALITY AS u(d, r, n, rec, dev, jud, o)
ORDER BY o
ON CONFLICT (device_id, reason) DO UPDATE
SET count = c.count + EXCLUDED.count,
    last_received_at = CASE WHEN EXCLUDED.last_received_at >= c.last_received_at
                            THEN EXCLUDED.last_received_at ELSE c.last_received_at END,
    last_device_ts = CASE WHEN EXCLUDED.last_received_at >= c.last_received_at
                          THEN EXCLUDED.last_device_ts ELSE c.last_device_ts END,
    last_judged_ts = CASE WHEN EXCLUDED.last_received_at >= c.last_received_at
                          THEN EXCLUDED.last_judged_ts ELSE c.last_judged_ts END;

-- name: device_adjustments
-- $1 device id; its clock figures, one row per reason, the latest first.
SELECT reason, count, last_received_at, last_device_ts, last_judged_ts
FROM device_clock
WHERE device_id = $1
ORDER BY last_received_at DESC, reason;
