-- name: insert_batch
-- The reference consumer's one statement per batch: $1 event ids, $2 device ids, $3 ts,
-- $4 seqs, $5 metrics json (arrays, pairwise); the same table and conflict rule as the gateway.
INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, node_id)
SELECT e, d, t, s, m::jsonb, 'reference'
FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::bigint[], $5::text[])
     AS u(e, d, t, s, m)
ON CONFLICT (event_id, ts) DO NOTHING;
