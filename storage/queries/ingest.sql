-- name: insert_telemetry
-- $1-$6 the rows, a column each, each a text of lines (storage.sql.lines, row by row in the
-- same order): event ids, device ids, ts as microseconds since 1970-01-01T00:00:00Z (turned
-- back exactly by from_micros, migration 0034), seqs, metrics json, events json; an empty
-- line is NULL (no id, time or JSON text is empty; a column of NULLs only may come as one
-- empty text, and unnest pads a shorter array with NULLs). Columns of lines, not an array of
-- `telemetry_write_us` records: asyncpg encodes each record of such an array with Python
-- checks of its own (measured on 500 rows, 2.1-2.5 µs of the client's CPU a row against
-- 0.8-0.9, and the statement's wall time 5.6-6.2 µs a row against 5.0-5.3).
-- $7 node id, $8 how many rows, $9 the devices heard from (a text of lines; unique, sorted
-- so that concurrent nodes lock rows in one order; empty: none), seen now, or at $10 when
-- not null: a replayed dead letter is heard when it was received, never later, and a newer
-- last_seen stays (the same conditions, against $10 instead of now()). One statement for
-- both, a round trip less a batch (issue 27). One row back: how many rows were new (a
-- redelivery is not), the transaction's time on the database clock (now(): the rules judge
-- new telemetry against it, and it comes here instead of in a round trip of its own), and
-- the new event ids only when some rows were not new: in the usual batch every row is, and
-- sending back every id (64 characters each) cost more than the rest of the answer.
-- The devices: a device not seen yet is registered. last_seen moves in steps of a second at
-- least: a device heard from in every batch would otherwise cost a row version per batch (as
-- much as its telemetry). It always moves when a presence newer than it says offline, which a
-- message now contradicts. Only the rows that move are locked (in device order): an INSERT …
-- ON CONFLICT DO UPDATE locks every row it meets, a WAL record per device per batch even
-- where the WHERE writes nothing (measured: 2.1 µs of PostgreSQL CPU per device against 0.9).
-- A re-check after waiting for another batch's lock sees that batch's last_seen and leaves the
-- row alone. The main query reads `inserted` only; PostgreSQL runs the sub-statements nothing
-- reads after it, so the telemetry is inserted before any device row is locked, as by the two
-- statements this one replaced (and every node runs this one statement: their locks come in
-- one order whatever order that is).
-- The row also carries the transaction's id (pg_current_xact_id, as a bigint; asking assigns
-- one, which a transaction that writes has anyway) and when the server answering it started
-- (pg_postmaster_start_time, or its last crash-restart: a backend killed (the OOM killer)
-- restarts every process but not the postmaster, and the WAL not flushed then is lost, its
-- transaction ids given out again; only the shared statistics' reset time tells, which a
-- crash-restart sets to its own): should the answer to its COMMIT be lost, the writer asks a
-- new connection whether it committed (xact_status) instead of storing the batch again, and
-- trusts the answer only from the same server, not restarted since (a reset of the bgwriter's
-- statistics by hand counts as a restart: the batch is stored again, as before). Here rather
-- than in a statement of its own: no round trip more a batch.
WITH inserted AS (
    INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, events, node_id)
    SELECT u.event_id, u.device_id, from_micros(u.ts_us::bigint), u.seq::bigint,
           u.metrics_json::jsonb, u.events_json::jsonb, $7
    FROM unnest(string_to_array($1, E'\n'), string_to_array($2, E'\n'),
                string_to_array($3, E'\n'), string_to_array($4, E'\n', ''),
                string_to_array($5, E'\n', ''), string_to_array($6, E'\n', ''))
         AS u(event_id, device_id, ts_us, seq, metrics_json, events_json)
    ORDER BY u.event_id
    ON CONFLICT (event_id, ts) DO NOTHING
    RETURNING event_id
), due AS (
    -- A join, not `device_id = ANY($9)`: a generic plan scans the table with an unhashed
    -- ANY, one comparison per device and id (measured: 0.6 -> 4.5 ms a batch of 500).
    SELECT d.device_id
    FROM unnest(string_to_array($9, E'\n')) AS u(id) JOIN device d ON d.device_id = u.id
    WHERE d.last_seen < coalesce($10::timestamptz, now()) - interval '1 second'
       OR (d.presence_at >= d.last_seen AND d.last_seen < coalesce($10::timestamptz, now()))
    ORDER BY d.device_id
    FOR NO KEY UPDATE OF d
), moved AS (
    UPDATE device SET last_seen = coalesce($10::timestamptz, now())
    FROM due WHERE device.device_id = due.device_id
), registered AS (
    INSERT INTO device (device_id, first_seen, last_seen)
    SELECT d, coalesce($10::timestamptz, now()), coalesce($10::timestamptz, now())
    FROM unnest(string_to_array($9, E'\n')) AS u(d)
    WHERE NOT EXISTS (SELECT FROM device x WHERE x.device_id = u.d)
    ON CONFLICT (device_id) DO NOTHING
)
SELECT count(*) AS new, now() AS db_now,
       CASE WHEN count(*) < $8 THEN coalesce(array_agg(event_id), '{}') END AS new_ids,
       pg_current_xact_id()::text::bigint AS xid, greatest(pg_postmaster_start_time(), pg_stat_get_bgwriter_stat_reset_time()) AS server_started
FROM inserted;

-- name: upsert_presence
-- $1 device ids (unique, sorted), $2 presences ('online'|'offline'); observed now, or at $3
-- when not null (a replayed dead letter: when it was received; replay applies it only to a
-- device neither heard, changed nor its presence read since (heard_since), so presence_at
-- never goes back). Only a
-- change is written: the status is retained, so every (re)connect of every node reads the
-- last one again, and moving presence_at to now would stand for a new silence (a new
-- inactivity alarm where people had closed the one for this silence).
-- $4 for each, how long before this statement the node read it off the broker (seconds, on
-- the node's monotonic clock), or NULL (not known: a Sparkplug birth or death); $5 the node.
-- The receipt goes on the database's clock as the statement's start less that age (off by
-- the statement's way to the server, about a millisecond or less: no wall clock of a node
-- is read), and is kept with the node (presence_received_at, presence_node; a replay's
-- receipt is $3). A change is written only when it was received after the presence stored,
-- or the same node stored that one (its order is the broker's, whatever the ages say; not
-- for a replay, whose order is no broker's: a replay that waited for the row's lock while
-- its node's live batch stored a newer reading was applied over it), or either receipt is
-- not known: a node a batch behind no longer overwrites another node's
-- newer `online` with the Will `offline` it read before it (a session takeover publishes
-- both within milliseconds). The same presence received later than the one stored moves
-- only the receipt and its node, never presence_at: a node that read the Will and the new
-- `online` in one batch stores no change, yet has read `online` after the Will another node
-- still holds. A stored receipt later than the clock now (clock_timestamp(), not the
-- statement's start: a statement that waited for the row's lock may have started before
-- the receipt it then reads) was put there by another clock, one ahead of this one (a
-- failover to a standby whose clock is behind, the database host's clock stepped back): it
-- orders nothing, as an unknown one, else until this clock reached it only the node that
-- stored it could change the device's presence (a node perhaps gone with the old primary).
-- Returns the transaction's id, as insert_telemetry does (for a batch that sends no
-- telemetry).
WITH recorded AS (
    INSERT INTO device AS dv
        (device_id, first_seen, last_seen, presence, presence_at, presence_received_at,
         presence_node)
    SELECT d, coalesce($3::timestamptz, now()), coalesce($3::timestamptz, now()), p,
           coalesce($3::timestamptz, now()),
           coalesce($3::timestamptz, statement_timestamp() - make_interval(secs => a)), $5
    FROM unnest($1::text[], $2::text[], $4::float8[]) AS u(d, p, a)
    ON CONFLICT (device_id) DO UPDATE
    SET presence = EXCLUDED.presence,
        presence_at = CASE WHEN dv.presence IS DISTINCT FROM EXCLUDED.presence
                           THEN EXCLUDED.presence_at ELSE dv.presence_at END,
        presence_received_at = EXCLUDED.presence_received_at,
        presence_node = EXCLUDED.presence_node
    WHERE CASE WHEN dv.presence IS DISTINCT FROM EXCLUDED.presence
               THEN ($3::timestamptz IS NULL
                     AND dv.presence_node IS NOT DISTINCT FROM EXCLUDED.presence_node)
                    OR dv.presence_received_at IS NULL
                    OR EXCLUDED.presence_received_at IS NULL
                    OR EXCLUDED.presence_received_at > dv.presence_received_at
                    OR dv.presence_received_at > clock_timestamp()
               ELSE EXCLUDED.presence_received_at
                    > coalesce(dv.presence_received_at, '-infinity')
                    OR dv.presence_received_at > clock_timestamp() END
)
SELECT pg_current_xact_id()::text::bigint AS xid, greatest(pg_postmaster_start_time(), pg_stat_get_bgwriter_stat_reset_time()) AS server_started;

-- name: insert_dead_letters
-- $1 topics, $2 payloads as kept (whole or first bytes), $3 whole sizes, $4 whole SHA-256 (hex),
-- $5 reason codes, $6 details, $7 times seen (each (topic, sha256) once), $8 node id, $9 for
-- each, how long before this statement the node read it off the broker (seconds; null: now),
-- its received_at on the database's clock: a message that waited in the node's queue (a
-- database outage) is received when it came, not when its letter could be written (a mapped
-- reading without a time of its own is replayed at that receipt). A pending
-- letter of the same bytes on the same topic (the key: the topic's MD5, migration 0049) is
-- counted again instead. Ids follow the order
-- given (message order); two nodes counting the same letters in opposite orders at once may
-- deadlock, which PostgreSQL breaks and the writer retries. Returns the transaction's id, as
-- insert_telemetry does (for a batch of dead letters only, which sends no telemetry).
WITH counted AS (
    INSERT INTO dead_letter AS l
        (topic, payload, payload_size, payload_sha256, reason, detail, seen_count, node_id,
         received_at, last_seen_at)
    SELECT t, p, s, h, r, d, n, $8,
           coalesce(statement_timestamp() - make_interval(secs => a), now()),
           coalesce(statement_timestamp() - make_interval(secs => a), now())
    FROM unnest($1::text[], $2::bytea[], $3::bigint[], $4::text[], $5::text[], $6::text[],
                $7::integer[], $9::float8[]) AS u(t, p, s, h, r, d, n, a)
    ON CONFLICT (md5(topic), payload_sha256) WHERE replayed_at IS NULL DO UPDATE
    SET seen_count = l.seen_count + EXCLUDED.seen_count,
        last_seen_at = GREATEST(l.last_seen_at, EXCLUDED.last_seen_at)
)
SELECT pg_current_xact_id()::text::bigint AS xid, greatest(pg_postmaster_start_time(), pg_stat_get_bgwriter_stat_reset_time()) AS server_started;

-- name: list_dead_letters
-- $1 reason filter or null, $2 only not yet replayed successfully, $3 after id (keyset), $4 limit.
SELECT id, topic, payload, reason, detail, received_at, node_id, replay_count, replayed_at,
       replay_outcome, payload_size, payload_sha256, seen_count, last_seen_at
FROM dead_letter
WHERE ($1::text IS NULL OR reason = $1)
  AND (NOT $2::boolean OR replayed_at IS NULL)
  AND id > $3
ORDER BY id
LIMIT $4;

-- name: dead_letters_of_reason
-- $1 ids, $2 reason; those of the ids whose letter has that reason.
SELECT id FROM dead_letter WHERE id = ANY ($1::bigint[]) AND reason = $2;

-- name: lock_dead_letter
-- $1 id; locks one dead letter for replay (skips one another replayer holds).
SELECT id, topic, payload, reason, detail, received_at, node_id, replay_count, replayed_at,
       replay_outcome, payload_size, payload_sha256, seen_count, last_seen_at
FROM dead_letter WHERE id = $1
FOR UPDATE SKIP LOCKED;

-- name: heard_since
-- $1 device ids, $2 a time; those whose presence changed, or was read again, or that were
-- heard after it: a replayed presence received at that time says nothing of them any more.
-- A presence read again unchanged moves only presence_received_at (upsert_presence): the
-- `online` of a device's new session after its Will, the Will dead-lettered, is newer news
-- than the Will, though presence_at stays (and the same node's presence would pass
-- upsert_presence's receipt order: "its own order", which a replay is not).
SELECT device_id FROM device
WHERE device_id = ANY($1::text[])
  AND (presence_at > $2 OR last_seen > $2 OR presence_received_at > $2);

-- name: mark_dead_letter_replayed
-- $1 id, $2 outcome ('stored'|'duplicate'|'presence'|'presence_superseded'|'receipt'|'empty'|
-- 'still_invalid: <code>'|'truncated'), $3 succeeded.
UPDATE dead_letter
SET replay_count = replay_count + 1,
    replay_outcome = $2,
    replayed_at = CASE WHEN $3::boolean THEN now() ELSE replayed_at END
WHERE id = $1;

-- name: assigned_xact_id
-- no parameters; the id of the caller's transaction if it has one (it wrote something), else
-- NULL, as a bigint, and when the server started (as insert_telemetry). For a batch that sent
-- none of insert_telemetry, upsert_presence and insert_dead_letters (command receipts only).
SELECT pg_current_xact_id_if_assigned()::text::bigint AS xid,
       greatest(pg_postmaster_start_time(), pg_stat_get_bgwriter_stat_reset_time()) AS server_started;

-- name: xact_status
-- $1 a transaction id (as a bigint), $2 when the server that gave it started: whether this is
-- that server, not restarted since, and if so the transaction's status ('committed', 'aborted',
-- 'in progress', or NULL when it is too old to tell). Asked on a new connection after the
-- answer to a batch's COMMIT was lost. Another server (a standby promoted since: the same ids
-- go on there, and one this server never received may since have been given to another
-- transaction) or a restart cannot answer for it: the status is not asked.
-- 'committed' comes before a synchronous standby has it: so it writes a WAL record (an id
-- alone does not), and this statement's commit waits for the standby as the batch's did.
WITH asked AS (
    SELECT CASE WHEN s.same THEN pg_xact_status($1::bigint::text::xid8) END AS status,
           s.same AS same_server
    FROM (SELECT greatest(pg_postmaster_start_time(), pg_stat_get_bgwriter_stat_reset_time())
                 = $2 AS same) AS s
)
SELECT same_server, status,
       CASE WHEN status = 'committed'
            THEN pg_logical_emit_message(true, 'gateway-commit-asked', '') END AS durable
FROM asked;

-- name: count_telemetry
-- no parameters; the number of stored telemetry rows.
SELECT count(*) FROM telemetry;

-- name: ping
-- no parameters; a cheap liveness probe.
SELECT 1;

-- name: upsert_device_mappings
-- $1 device ids (unique, sorted), $2 mapping names, $3 topic wildcards (JSON objects). Only a
-- change is written: most messages come from a device already known with the same wildcards.
INSERT INTO device_mapping (device_id, mapping, captures, updated_at)
SELECT d, m, c::jsonb, now() FROM unnest($1::text[], $2::text[], $3::text[]) AS u(d, m, c)
ON CONFLICT (device_id) DO UPDATE
SET mapping = EXCLUDED.mapping, captures = EXCLUDED.captures, updated_at = now()
WHERE (device_mapping.mapping, device_mapping.captures)
    IS DISTINCT FROM (EXCLUDED.mapping, EXCLUDED.captures);

-- name: device_mappings
-- $1 device ids: the mapping and topic wildcards of those seen through a mapping.
SELECT device_id, mapping, captures::text AS captures
FROM device_mapping WHERE device_id = ANY($1::text[]);

-- name: clock_now
-- No parameters; the database's clock as the statement runs (clock_timestamp(): the moment,
-- not the transaction's start): what a node sets its estimate of that clock by
-- (gateway.support.db_clock).
SELECT clock_timestamp();

-- name: record_mapped_frames
-- The batch's mapping records and the LoRaWAN retransmission check (gateway.ingest.store), in
-- one statement, one round trip (docs/devices.md): the check used to take three of its own
-- (insert the records missing, lock them, write the last frames) besides
-- upsert_device_mappings. $1 device ids (unique, sorted): those whose readings name a radio
-- frame and those whose record is due; for each, $2 its mapping and $3 its topic wildcards
-- (a JSON object), both NULL when its record is not due (left as it is), $4 the last frame
-- read from it in the batch (NULL: none); $5 the window in seconds. Every record that exists
-- is locked first, in device order (nodes of a shared group decide one after another, and
-- lock in one order: no deadlock between their batches), then written: the frame and now,
-- the mapping and wildcards where they differ. A record not found is inserted, unless its
-- mapping is not due. One row back per record found: its frame before this statement (NULL:
-- none) and whether it was read within the window; one per record inserted (no frame). A
-- device with no row back has no record yet to the statement: one inserted by a batch the
-- statement waited for (ON CONFLICT DO NOTHING waits for it), or a record not due that is
-- gone (a failover lost it): the caller asks again for those, with their mapping.
-- The main query reads `locked` and `inserted`; `updated`, which nothing reads, runs after
-- it, on rows `locked` holds already.
WITH u AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS u(d, m, c, f)
), locked AS (
    SELECT device_id, frame,
           coalesce(frame_at >= now() - make_interval(secs => $5), false) AS recent
    FROM device_mapping WHERE device_id = ANY($1::text[])
    ORDER BY device_id
    FOR NO KEY UPDATE
), updated AS (
    UPDATE device_mapping dm
    SET mapping = coalesce(u.m, dm.mapping),
        captures = coalesce(u.c::jsonb, dm.captures),
        updated_at = CASE WHEN u.m IS NOT NULL
                               AND (dm.mapping, dm.captures) IS DISTINCT FROM (u.m, u.c::jsonb)
                          THEN now() ELSE dm.updated_at END,
        frame = coalesce(u.f, dm.frame),
        frame_at = CASE WHEN u.f IS NULL THEN dm.frame_at ELSE now() END
    FROM u JOIN locked l ON l.device_id = u.d
    WHERE dm.device_id = u.d
      AND (u.f IS NOT NULL
           OR (u.m IS NOT NULL
               AND (dm.mapping, dm.captures) IS DISTINCT FROM (u.m, u.c::jsonb)))
), inserted AS (
    INSERT INTO device_mapping (device_id, mapping, captures, updated_at, frame, frame_at)
    SELECT u.d, u.m, u.c::jsonb, now(), u.f, CASE WHEN u.f IS NOT NULL THEN now() END
    FROM u
    WHERE u.m IS NOT NULL AND NOT EXISTS (SELECT FROM locked l WHERE l.device_id = u.d)
    ORDER BY u.d
    ON CONFLICT (device_id) DO NOTHING
    RETURNING device_id
)
SELECT device_id, frame, recent FROM locked
UNION ALL
SELECT device_id, NULL, false FROM inserted;
