-- name: device_page
-- $1 presence or null, $2 after device id (keyset, ascending) or null, $3 limit; devices with
-- their open alarm count (open: NEW, PUSHED, DELAYED, CONFIRMED, ESCALATED, as GET /alarms).
SELECT d.device_id, d.presence, d.first_seen, d.last_seen, d.bound,
       (SELECT count(*) FROM alarm a
        WHERE a.device_id = d.device_id
          AND a.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED')) AS open_alarms
FROM device d
WHERE ($1::text IS NULL OR d.presence = $1)
  AND ($2::text IS NULL OR d.device_id > $2)
ORDER BY d.device_id
LIMIT $3;

-- name: device
-- $1 device id; the device with its open alarm count, as in device_page.
SELECT d.device_id, d.presence, d.first_seen, d.last_seen, d.bound,
       (SELECT count(*) FROM alarm a
        WHERE a.device_id = d.device_id
          AND a.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED')) AS open_alarms
FROM device d
WHERE d.device_id = $1;

-- name: latest_samples
-- $1 device id, $2 how many; the device's newest samples (metrics and events as json text),
-- newest first. Uses the (device_id, ts DESC) index, partitioned or not.
SELECT ts, metrics::text AS metrics, events::text AS events
FROM telemetry
WHERE device_id = $1
ORDER BY ts DESC, event_id DESC
LIMIT $2;

-- name: telemetry_page
-- $1 device id, $2 since (inclusive) or null, $3 until (exclusive) or null, $4 cursor ts or
-- null, $5 cursor event id (with $4), $6 metric or null, $7 limit; newest first, keyset on
-- (ts, event_id): exact when several samples share a ts.
SELECT event_id, ts, seq, metrics::text AS metrics, events::text AS events
FROM telemetry
WHERE device_id = $1
  AND ($2::timestamptz IS NULL OR ts >= $2)
  AND ($3::timestamptz IS NULL OR ts < $3)
  AND ($4::timestamptz IS NULL OR (ts, event_id) < ($4, $5::text))
  AND ($6::text IS NULL OR metrics ? $6)
ORDER BY ts DESC, event_id DESC
LIMIT $7;

-- name: dead_letter_page
-- $1 reason or null, $2 before id (keyset, newest first) or null, $3 limit.
SELECT id, topic, reason, detail, payload_size AS size, octet_length(payload) AS kept,
       received_at, node_id, replay_count, replayed_at, replay_outcome
FROM dead_letter
WHERE ($1::text IS NULL OR reason = $1)
  AND ($2::bigint IS NULL OR id < $2)
ORDER BY id DESC
LIMIT $3;

-- name: dead_letter_exists
-- $1 id.
SELECT EXISTS (SELECT 1 FROM dead_letter WHERE id = $1);

-- name: dead_letter
-- $1 id; one dead letter with its payload (as kept: at most [ingest] dead_letter_max_bytes).
SELECT id, topic, reason, detail, payload_size AS size, octet_length(payload) AS kept,
       received_at, node_id, replay_count, replayed_at, replay_outcome, payload,
       payload_sha256, seen_count, last_seen_at
FROM dead_letter WHERE id = $1;

-- name: lock_dead_letter_for_discard
-- $1 id; locks the letter, or nothing when it is gone or a replay holds it right now.
SELECT id FROM dead_letter WHERE id = $1 FOR UPDATE SKIP LOCKED;

-- name: discard_dead_letter
-- $1 id (locked by lock_dead_letter_for_discard), $2 actor, $3 node id, $4 request id; deletes
-- the letter and writes its audit row in one statement.
WITH gone AS (
    DELETE FROM dead_letter WHERE id = $1
    RETURNING id, topic, reason, payload_size, payload_sha256, replay_count, replay_outcome
)
INSERT INTO dead_letter_audit (dead_letter_id, action, actor, topic, reason, payload_size,
                               payload_sha256, replay_count, replay_outcome, node_id, request_id)
SELECT id, 'discard', $2, topic, reason, payload_size, payload_sha256, replay_count,
       replay_outcome, $3, $4
FROM gone
RETURNING dead_letter_id, actor, at;

-- name: dead_letter_discarded
-- $1 id; who discarded it and when (nothing if it never was).
SELECT dead_letter_id, actor, at FROM dead_letter_audit
WHERE dead_letter_id = $1 AND action = 'discard';

-- name: insert_ticket
-- $1 digest, $2 token name, $3 role, $4 lifetime seconds, $5 token check (the token it was
-- issued to, bound to the ticket; null for none); expires_at on the database clock.
INSERT INTO stream_ticket (digest, token_name, role, expires_at, token_check)
VALUES ($1, $2, $3, now() + make_interval(secs => $4), $5)
RETURNING expires_at;

-- name: use_ticket
-- $1 digest; marks an unused, unexpired ticket used and returns its token name, role and
-- token check (nothing for an unknown, used or expired one: any node, exactly once).
UPDATE stream_ticket
SET used_at = now()
WHERE digest = $1 AND used_at IS NULL AND expires_at > now()
RETURNING token_name, role, token_check;

-- name: stream_cursor_ahead
-- $1 xid (text), $2 id, $3 horizon (stream_horizon, text); whether the cursor is past every
-- event a stream can have sent: its transaction is not below the horizon (events are sent only
-- below it), or its id is beyond the outbox sequence's last value.
SELECT $1::text::xid8 >= $3::text::xid8
    OR $2::bigint > coalesce(
        pg_sequence_last_value(pg_get_serial_sequence('outbox_event', 'id')::regclass), 0)
    AS ahead;

-- name: stream_horizon
-- no parameters; every transaction of this database with an xid below this has ended: events
-- below it are final. The oldest transaction still running in this database (a prepared one
-- too), else the snapshot's xmax: a transaction of another database on the same server (an
-- application's, a migration's) writes no event here, and holds no stream back while it runs
-- (the server-wide pg_snapshot_xmin did: one open write anywhere stopped every console). Read
-- after the snapshot, a transaction of the xip list no longer running has ended, and a
-- statement after this one sees it. backend_xid and datid are shown to any role. The xid8s
-- of the list are matched to the 32-bit xids by their low 32 bits.
WITH s AS (SELECT pg_current_snapshot() AS snap),
here AS (
    SELECT backend_xid AS x FROM pg_stat_activity
    WHERE datid = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND backend_xid IS NOT NULL
    UNION ALL
    SELECT transaction FROM pg_prepared_xacts WHERE database = current_database()
)
SELECT coalesce(
           (SELECT min(r) FROM pg_snapshot_xip(s.snap) AS r
            WHERE ((r::text::bigint % 4294967296)::text)::xid IN (SELECT x FROM here)),
           pg_snapshot_xmax(s.snap))::text AS horizon
FROM s;

-- name: stream_events
-- $1 after xid (exclusive, with $2) or null for the start, $2 after id, $3 horizon (exclusive),
-- $4 limit; the outbox's events in (xid, id) order, only those whose transaction and every
-- older one have ended. ORDER BY names the table's column: the bare `xid` would be the text
-- output column, ordered as text ('10000' before '9999'), and a batch could skip events.
SELECT xid::text AS xid, id, event_id, event_type, aggregate_type, aggregate_id,
       payload::text AS payload, created_at
FROM outbox_event
WHERE ($1::text IS NULL OR (xid, id) > ($1::text::xid8, $2::bigint))
  AND xid < $3::text::xid8
ORDER BY outbox_event.xid, outbox_event.id
LIMIT $4;

-- name: stream_tail
-- $1 horizon (stream_horizon, text); the cursor of the newest event a stream may deliver now
-- (none: null).
SELECT xid::text AS xid, id FROM outbox_event
WHERE xid < $1::text::xid8
ORDER BY outbox_event.xid DESC, outbox_event.id DESC
LIMIT 1;
