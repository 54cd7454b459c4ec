-- name: insert_one
-- The naive baseline's statement, one message per transaction: $1 event id, $2 device id,
-- $3 ts, $4 seq, $5 metrics json, $6 node id.
INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, node_id)
VALUES ($1, $2, $3, $4, $5::jsonb, $6)
ON CONFLICT (event_id, ts) DO NOTHING;
