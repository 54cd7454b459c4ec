-- The metric names and event types stored in telemetry, for the rule check. Every query is
-- bounded by `received_at` (when the row was stored, on the database's clock; a BRIN index
-- on every partition, migration 0017), never a whole-table scan. Not by `ts`, the device
-- time: a fleet whose clocks restart at 1970 or run hours behind sent the rule's name all
-- along, and a row dated years ahead, received long ago, is no name seen in the window.

-- name: metric_names
-- $1 since (timestamptz: received since), $2 at most this many rows looked at (NULL: every
-- row since $1);
-- the distinct metric names of those rows.
SELECT DISTINCT k.name
FROM (
    SELECT metrics FROM telemetry
    WHERE received_at >= $1 AND metrics IS NOT NULL
    LIMIT $2
) AS t
CROSS JOIN LATERAL jsonb_object_keys(t.metrics) AS k(name)
ORDER BY k.name;

-- name: event_types
-- $1 since (timestamptz: received since), $2 at most this many rows looked at (NULL: every
-- row since $1);
-- the distinct event types (each event's "type") of those rows.
SELECT DISTINCT e.event ->> 'type' AS name
FROM (
    SELECT events FROM telemetry
    WHERE received_at >= $1 AND events IS NOT NULL
    LIMIT $2
) AS t
CROSS JOIN LATERAL jsonb_array_elements(t.events) AS e(event)
WHERE e.event ->> 'type' IS NOT NULL
ORDER BY name;

-- name: metric_seen
-- $1 since (timestamptz), $2 metric name; whether any row since $1 carries it.
SELECT EXISTS (SELECT 1 FROM telemetry WHERE received_at >= $1 AND metrics ? $2::text);

-- name: event_seen
-- $1 since (timestamptz), $2 event type; whether any row since $1 carries an event of it.
SELECT EXISTS (
    SELECT 1 FROM telemetry
    WHERE received_at >= $1 AND events @> jsonb_build_array(jsonb_build_object('type', $2::text))
);
