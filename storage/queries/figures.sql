-- The alarm system's own figures (docs/alarm-figures.md): read-only, over `alarm` and
-- `alarm_audit`, each on an index of migration 0025. A window is [$1, $2): alarms by their
-- trigger time, people's actions by the time of their audit row. Intervals of 10 minutes are
-- fixed ones, aligned to the epoch (:00, :10, ... UTC), as EEMUA 191 counts them.

-- name: no_jit
-- No parameters. The figures' statements are short scans whose row estimates (window
-- functions, grouping sets) can pass jit_above_cost: compiling would cost more than running
-- them (measured: 0.7 s of JIT for a 0.1 s statement). For the caller's transaction only.
SET LOCAL jit = off;

-- name: per_interval
-- $1 from, $2 until; every 10-minute interval that meets the window, oldest first, with the
-- alarms raised in it within the window (0 for none).
WITH counted AS (
    SELECT date_bin('10 minutes', triggered_at, timestamptz '1970-01-01 00:00:00+00') AS starts_at,
           count(*) AS alarms
    FROM alarm
    WHERE triggered_at >= $1 AND triggered_at < $2
    GROUP BY 1
)
SELECT s.starts_at, coalesce(c.alarms, 0)::bigint AS alarms
FROM generate_series(date_bin('10 minutes', $1::timestamptz, timestamptz '1970-01-01 00:00:00+00'),
                     $2::timestamptz - interval '1 microsecond', interval '10 minutes')
     AS s(starts_at)
LEFT JOIN counted c ON c.starts_at = s.starts_at
ORDER BY s.starts_at;

-- name: floods
-- $1 from, $2 until, $3 flood threshold; flood periods: runs of consecutive 10-minute
-- intervals each holding more than $3 alarms of the window, with their alarms and peak.
WITH counted AS (
    SELECT date_bin('10 minutes', triggered_at, timestamptz '1970-01-01 00:00:00+00') AS starts_at,
           count(*) AS alarms
    FROM alarm
    WHERE triggered_at >= $1 AND triggered_at < $2
    GROUP BY 1
), flooded AS (
    SELECT starts_at, alarms,
           starts_at - (row_number() OVER (ORDER BY starts_at)) * interval '10 minutes' AS run
    FROM counted
    WHERE alarms > $3
)
SELECT min(starts_at) AS starts_at, max(starts_at) + interval '10 minutes' AS ends_at,
       count(*)::bigint AS intervals, sum(alarms)::bigint AS alarms, max(alarms)::bigint AS peak
FROM flooded
GROUP BY run
ORDER BY 1;

-- name: top_rules
-- $1 from, $2 until, $3 how many; the rules that raised the most alarms in the window.
SELECT rule_key AS key, count(*)::bigint AS alarms
FROM alarm
WHERE triggered_at >= $1 AND triggered_at < $2
GROUP BY rule_key
ORDER BY alarms DESC, rule_key
LIMIT $3;

-- name: top_devices
-- $1 from, $2 until, $3 how many; the devices that raised the most alarms in the window.
SELECT device_id AS key, count(*)::bigint AS alarms
FROM alarm
WHERE triggered_at >= $1 AND triggered_at < $2
GROUP BY device_id
ORDER BY alarms DESC, device_id
LIMIT $3;

-- name: chattering
-- $1 from, $2 until, $3 chatter window (seconds: an interval of days would be added in the
-- session's time zone, 25 hours on the day the clocks go back), $4 raises that make chatter,
-- $5 how many;
-- the (rule, device) pairs that raised $4 alarms or more within $3 (the first and the last
-- at most $3 apart) inside the window, most chattering first, each with its alarms in the
-- window, its most raises within $3 and when it first reached $4; `total` counts them all.
WITH raised AS (
    SELECT rule_key, device_id, triggered_at,
           count(*) OVER (PARTITION BY rule_key, device_id ORDER BY triggered_at
                          RANGE BETWEEN make_interval(secs => $3) PRECEDING AND CURRENT ROW) AS within
    FROM alarm
    WHERE triggered_at >= $1 AND triggered_at < $2
), pairs AS (
    SELECT rule_key, device_id, count(*)::bigint AS alarms, max(within)::bigint AS peak,
           min(triggered_at) FILTER (WHERE within >= $4) AS since
    FROM raised
    GROUP BY rule_key, device_id
    HAVING max(within) >= $4
)
SELECT rule_key, device_id, alarms, peak, since, count(*) OVER ()::bigint AS total
FROM pairs
ORDER BY peak DESC, alarms DESC, rule_key, device_id
LIMIT $5;

-- name: stale
-- $1 open since before (now - stale age), $2 how many; the oldest open alarms raised before
-- $1; `total` counts them all.
SELECT id, device_id, rule_key, severity, status, triggered_at, count(*) OVER ()::bigint AS total
FROM alarm
WHERE status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED') AND triggered_at < $1
ORDER BY triggered_at, id
LIMIT $2;

-- name: operators
-- $1 from, $2 until; people's actions (confirm, handle, close, false) recorded in the window,
-- per actor (the token's name) and in all (the row whose actor is null): actions, alarms acted
-- on, the most actions in one 10-minute interval, and acknowledgements: an alarm's first
-- person's action, with the seconds from its trigger, or from its wake when quiet hours held
-- it (it rang nobody before: a person's step while it was held leaves it unwoken) (median,
-- 90th percentile, longest).
WITH acted AS (
    SELECT au.alarm_id, au.actor, au.at,
           CASE WHEN NOT EXISTS (
                    SELECT 1 FROM alarm_audit earlier
                    WHERE earlier.alarm_id = au.alarm_id AND earlier.id < au.id
                      AND earlier.action IN ('confirm', 'handle', 'close', 'false')
                )
                THEN extract(epoch FROM au.at - coalesce(a.woken_at, a.triggered_at))::float8
           END AS ack_s
    FROM alarm_audit au
    JOIN alarm a ON a.id = au.alarm_id
    WHERE au.action IN ('confirm', 'handle', 'close', 'false') AND au.at >= $1 AND au.at < $2
), peaks AS (
    SELECT actor, max(actions)::bigint AS peak
    FROM (
        SELECT actor, date_bin('10 minutes', at, timestamptz '1970-01-01 00:00:00+00'),
               count(*) AS actions
        FROM acted
        GROUP BY 1, 2
    ) per_interval
    GROUP BY actor
), figures AS (
    SELECT actor, grouping(actor) = 1 AS everyone,
           count(*)::bigint AS actions,
           count(DISTINCT alarm_id)::bigint AS alarms,
           count(ack_s)::bigint AS acknowledged,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY ack_s) AS ack_median_s,
           percentile_cont(0.9) WITHIN GROUP (ORDER BY ack_s) AS ack_p90_s,
           max(ack_s) AS ack_max_s
    FROM acted
    GROUP BY GROUPING SETS ((actor), ())
)
SELECT f.actor, f.everyone, f.actions, f.alarms, f.acknowledged, f.ack_median_s, f.ack_p90_s,
       f.ack_max_s, coalesce(p.peak, 0)::bigint AS peak
FROM figures f
LEFT JOIN peaks p ON p.actor = f.actor AND NOT f.everyone
ORDER BY f.everyone DESC, f.actions DESC, f.actor;

-- name: gauges
-- $1 now, $2 chatter window (seconds, as chattering's), $3 raises that make chatter, $4
-- chattering looked for since, $5 stale: open since before; what the figures' gauges show:
-- alarms raised in the last 10 minutes, chattering pairs since $4, stale alarms, open alarms.
SELECT
    (SELECT count(*) FROM alarm
     WHERE triggered_at >= $1::timestamptz - interval '10 minutes' AND triggered_at < $1)::bigint
        AS last_10min,
    (SELECT count(*) FROM (
        SELECT 1
        FROM (
            SELECT rule_key, device_id,
                   count(*) OVER (PARTITION BY rule_key, device_id ORDER BY triggered_at
                                  RANGE BETWEEN make_interval(secs => $2) PRECEDING AND CURRENT ROW) AS within
            FROM alarm
            WHERE triggered_at >= $4 AND triggered_at < $1
        ) raised
        GROUP BY rule_key, device_id
        HAVING max(within) >= $3
    ) pairs)::bigint AS chattering,
    (SELECT count(*) FROM alarm
     WHERE status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED')
       AND triggered_at < $5)::bigint AS stale,
    (SELECT count(*) FROM alarm
     WHERE status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED'))::bigint AS open;
