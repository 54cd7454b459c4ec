-- name: try_lock
-- $1 advisory lock key, $2 a duration ('30000ms'), $3 a duration ('5000ms'); true when this
-- session now holds it (one maintenance runner at a time). The holder's session is then ended
-- by the server once it has sat $2 between statements (idle_session_timeout, PostgreSQL 14 and
-- later): a holder whose process stopped (a VM paused, SIGSTOP) or whose link went silent keeps
-- a connection its kernel still answers, which TCP keepalive never ends, and every other node
-- skipped every pass until someone killed it. A pass runs its statements back to back. And,
-- while a statement of the holder runs, the server looks every $3 whether its client's socket
-- is closed (client_connection_check_interval, PostgreSQL 14 and later), and ends the statement
-- and the session if so: a link cut under a running statement left it running, and the lock
-- held, until it ended. Set in the same statement as the lock, so no holder is ever without
-- them; a session that did not get the lock is left as it was (a pooled connection, idle
-- between uses). On an older server the settings do not exist and nothing is set. The check is
-- set only on a server platform that has it: any value but 0 is an error elsewhere (Windows;
-- PostgreSQL 14 has it on Linux only, 15 on macOS and the BSDs too), and an error here would
-- come after the lock was taken, which a failed statement does not let go (a session lock).
SELECT CASE WHEN pg_try_advisory_lock($1)
            THEN (SELECT count(set_config(name,
                                          CASE name WHEN 'idle_session_timeout' THEN $2::text
                                                    ELSE $3::text END,
                                          false))
                  FROM pg_settings
                  WHERE name = 'idle_session_timeout'
                     OR (name = 'client_connection_check_interval'
                         AND (version() ~ ' on [^,]*-linux'
                              OR (current_setting('server_version_num')::int >= 150000
                                  AND version() ~ ' on [^,]*(darwin|freebsd|netbsd|openbsd)'))))
                 >= 0
            ELSE false END;

-- name: unlock
-- $1 advisory lock key; and idle_session_timeout and client_connection_check_interval back to
-- the session's defaults (the connection goes back to the pool, where it is idle between uses).
SELECT pg_advisory_unlock($1),
       (SELECT count(set_config(name, reset_val, false)) FROM pg_settings
        WHERE name IN ('idle_session_timeout', 'client_connection_check_interval'));

-- name: db_now
-- no parameters; the database's clock, which stamped every row the pass compares with its
-- cut-offs (received_at, last_seen_at, published_at, finished_at, at, created_at).
SELECT now();

-- name: lock_timeout
-- $1 lock timeout (e.g. '5s'), for the rest of the caller's transaction only; and no
-- statement_timeout there (a role's or the server's): a partition change moving a big day
-- must finish, or it is rolled back and tried again, whole, at every pass.
SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', '0', true);

-- name: day_partitions
-- no parameters; the UTC days that have a telemetry partition, oldest first.
SELECT to_date(substr(c.relname, 12), 'YYYYMMDD') AS day
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'telemetry'::regclass AND c.relname ~ '^telemetry_p[0-9]{8}$'
ORDER BY 1;

-- name: add_day_partition
-- $1 UTC day; creates its partition (moving its rows out of the default one); false if it was
-- there already.
SELECT telemetry_add_day_partition($1::date);

-- name: drop_day_partition
-- $1 UTC day, $2 cut-off; drops its partition, keeping its rows received since the cut-off (in
-- the default partition); false if there was none.
SELECT telemetry_drop_day_partition($1::date, $2::timestamptz);

-- name: default_partition_pages
-- no parameters; the default partition's size in pages (its rows live in pages 0..n-1).
SELECT (pg_relation_size('telemetry_default') / current_setting('block_size')::bigint)::bigint;

-- name: prune_default_partition
-- $1 first page, $2 page after the last, $3 cut-off; deletes the default partition's rows
-- received before the cut-off within those pages (a TID range scan: a bounded batch whatever
-- the partition holds). By receipt, not by device time: a sample with a clock far behind or
-- ahead stays telemetry_days after it arrived, and no longer.
DELETE FROM telemetry_default
WHERE ctid >= format('(%s,0)', $1::bigint)::tid
  AND ctid < format('(%s,0)', $2::bigint)::tid
  AND received_at < $3;

-- The batches below walk a table by id, $3 rows at a time from after id $1, and act on the
-- rows of the chunk that are past the cut-off $2 and not live. Each returns how many rows it
-- deleted (or cleared), the last id of the chunk (null: the table ends) and the oldest
-- creation time in the chunk: rows are created in id order, so once that time is past the
-- cut-off, nothing further can be old enough and the walk stops.

-- name: prune_dead_letters
-- $1 after id, $2 cut-off, $3 chunk; letters last seen before the cut-off, replayed or not.
WITH chunk AS (
    SELECT id, received_at, last_seen_at FROM dead_letter WHERE id > $1 ORDER BY id LIMIT $3
), gone AS (
    DELETE FROM dead_letter
    -- Checked again on the row itself: a letter seen again meanwhile stays.
    WHERE id IN (SELECT id FROM chunk WHERE last_seen_at < $2) AND last_seen_at < $2
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS done, (SELECT max(id) FROM chunk) AS last_id,
       (SELECT min(received_at) FROM chunk) AS oldest;

-- name: prune_alarm_audit
-- $1 after id, $2 cut-off, $3 chunk; audit rows before the cut-off of alarms that ended
-- (CLOSED, FALSE, SUPERSEDED) before it. An alarm still open keeps its whole trail.
WITH chunk AS (
    SELECT au.id, au.at, a.status,
           coalesce(a.closed_at, a.false_at, a.superseded_at) AS ended_at
    FROM alarm_audit au JOIN alarm a ON a.id = au.alarm_id
    WHERE au.id > $1 ORDER BY au.id LIMIT $3
), gone AS (
    DELETE FROM alarm_audit
    WHERE id IN (SELECT id FROM chunk
                 WHERE at < $2 AND status IN ('CLOSED', 'FALSE', 'SUPERSEDED')
                   AND ended_at < $2)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS done, (SELECT max(id) FROM chunk) AS last_id,
       (SELECT min(at) FROM chunk) AS oldest;

-- name: prune_command_audit
-- $1 after id, $2 cut-off, $3 chunk; audit rows before the cut-off of commands that finished
-- (ACKED, FAILED, TIMEOUT, CANCELLED) before it. A command still open keeps its whole trail.
WITH chunk AS (
    SELECT au.id, au.at, c.finished_at
    FROM command_audit au JOIN command c ON c.id = au.command_id
    WHERE au.id > $1 ORDER BY au.id LIMIT $3
), gone AS (
    DELETE FROM command_audit
    WHERE id IN (SELECT id FROM chunk WHERE at < $2 AND finished_at < $2)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS done, (SELECT max(id) FROM chunk) AS last_id,
       (SELECT min(at) FROM chunk) AS oldest;

-- name: prune_dead_letter_audit
-- $1 after id, $2 cut-off, $3 chunk; discards recorded before the cut-off (the letters they
-- describe are gone already).
WITH chunk AS (
    SELECT id, at FROM dead_letter_audit WHERE id > $1 ORDER BY id LIMIT $3
), gone AS (
    DELETE FROM dead_letter_audit WHERE id IN (SELECT id FROM chunk WHERE at < $2)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS done, (SELECT max(id) FROM chunk) AS last_id,
       (SELECT min(at) FROM chunk) AS oldest;

-- name: prune_receipts
-- $1 after id, $2 cut-off, $3 chunk; receipts received before the cut-off that name no known
-- command, or whose command finished before it. Receipts of an open command stay.
WITH chunk AS (
    SELECT r.id, r.received_at, r.command_id, c.finished_at
    FROM command_receipt r LEFT JOIN command c ON c.id = r.command_id
    WHERE r.id > $1 ORDER BY r.id LIMIT $3
), gone AS (
    DELETE FROM command_receipt
    WHERE id IN (SELECT id FROM chunk
                 WHERE received_at < $2 AND (command_id IS NULL OR finished_at < $2))
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS done, (SELECT max(id) FROM chunk) AS last_id,
       (SELECT min(received_at) FROM chunk) AS oldest;

-- name: prune_outbox
-- $1 after id, $2 cut-off, $3 chunk; events PUBLISHED before the cut-off. PENDING and
-- PUBLISHING events stay, however old.
WITH chunk AS (
    SELECT id, created_at, status, published_at FROM outbox_event
    WHERE id > $1 ORDER BY id LIMIT $3
), gone AS (
    DELETE FROM outbox_event
    WHERE id IN (SELECT id FROM chunk WHERE status = 'PUBLISHED' AND published_at < $2)
      AND status = 'PUBLISHED'
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS done, (SELECT max(id) FROM chunk) AS last_id,
       (SELECT min(created_at) FROM chunk) AS oldest;

-- name: prune_outbox_dead
-- $1 after id, $2 cut-off, $3 chunk; events DEAD (the broker can never take them) since before
-- the cut-off. Open events stay, however old. One without dead_at (it died before migration
-- 0055, or on a node of the previous release) counts from next_retry_at, when it was last
-- due. An event may die long after it was made (retried with backoff): the walk's stop on
-- creation time is safe all the same, since neither time is before created_at.
WITH chunk AS (
    SELECT id, created_at FROM outbox_event WHERE id > $1 ORDER BY id LIMIT $3
), gone AS (
    DELETE FROM outbox_event
    WHERE id IN (SELECT id FROM chunk) AND status = 'DEAD'
      AND coalesce(dead_at, next_retry_at) < $2
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS done, (SELECT max(id) FROM chunk) AS last_id,
       (SELECT min(created_at) FROM chunk) AS oldest;

-- name: prune_deliveries
-- $1 after id, $2 cut-off, $3 chunk; notification deliveries that ended (SENT, FAILED,
-- SILENCED, INHIBITED,
-- SUPPRESSED) before the cut-off. PENDING and SENDING ones stay, however old. So does the
-- latest window of a group that repeats while it still carries an alarm (notify_group_member
-- rows: alarms not yet found dealt with): its repeats are made from that window (repeat_due);
-- pruned, the group's reminders of its open alarms stopped for good (a weekly repeat with
-- notify_days = 3 reminded once). One row per group; it goes once its alarms are dealt with.
-- And so does the newest notification of a standing alarm (open, not cleared) on each receiver
-- of a route that does not group: a shelf's end tells the alarm again from it when a shelf
-- suppressed it (notify.sql, shelf_returns); pruned, an alarm shelved longer than notify_days
-- came back from its shelf untold. The newest whatever it is, not the suppressed ones alone: a
-- return told since, pruned, would leave the suppressed one before it the newest, to be told
-- again at the next shelf's end. One row per alarm and receiver.
WITH chunk AS (
    SELECT id, created_at FROM notify_delivery WHERE id > $1 ORDER BY id LIMIT $3
), gone AS (
    DELETE FROM notify_delivery d
    WHERE d.id IN (SELECT id FROM chunk)
      AND d.status IN ('SENT', 'FAILED', 'SILENCED', 'INHIBITED', 'SUPPRESSED')
      AND d.finished_at < $2
      AND d.id NOT IN (
          SELECT g.window_delivery_id FROM notify_group g
          WHERE g.window_delivery_id IS NOT NULL AND g.repeat_interval_s > 0
            AND EXISTS (SELECT 1 FROM notify_group_member m WHERE m.group_id = g.id))
      AND NOT (
          d.alarm_id IS NOT NULL AND d.route_grouped IS FALSE
          AND EXISTS (
              SELECT 1 FROM alarm a
              WHERE a.id = d.alarm_id AND a.cleared_at IS NULL
                AND a.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED'))
          AND NOT EXISTS (
              SELECT 1 FROM notify_delivery n
              WHERE n.alarm_id = d.alarm_id AND n.receiver = d.receiver
                AND n.route_grouped IS FALSE
                AND (n.event_created_at, n.id) > (d.event_created_at, d.id)))
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS done, (SELECT max(id) FROM chunk) AS last_id,
       (SELECT min(created_at) FROM chunk) AS oldest;

-- name: prune_consumed
-- $1 cut-off, $2 batch; consumer records made before the cut-off (the events they name were
-- published long before and are pruned with the outbox by then).
WITH doomed AS (
    SELECT consumer, event_id FROM consumed_event WHERE consumed_at < $1 LIMIT $2
), gone AS (
    DELETE FROM consumed_event c USING doomed d
    WHERE c.consumer = d.consumer AND c.event_id = d.event_id
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_notify_groups
-- $1 cut-off, $2 batch; notification groups made before the cut-off none of whose deliveries
-- remain (their windows were pruned): a notification of the group makes it again (with a
-- new id, so its windows' ids are new too). One a consumer holds is skipped.
WITH doomed AS (
    SELECT g.id FROM notify_group g
    WHERE g.created_at < $1
      AND NOT EXISTS (SELECT 1 FROM notify_delivery d WHERE d.group_id = g.id)
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM notify_group g USING doomed
    WHERE g.id = doomed.id
      AND NOT EXISTS (SELECT 1 FROM notify_delivery d WHERE d.group_id = g.id)
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_ai_payloads
-- $1 after id, $2 cut-off, $3 chunk, $4 now; clears request_payload and raw_response of tasks
-- that finished (SUCCEEDED, FAILED) before the cut-off. Open tasks keep theirs; the task row,
-- its summary and its error stay. Walks only the tasks whose payloads are still there.
WITH chunk AS (
    SELECT id, created_at, status, finished_at FROM ai_task
    WHERE payload_pruned_at IS NULL AND id > $1 ORDER BY id LIMIT $3
), cleared AS (
    UPDATE ai_task
    SET request_payload = NULL, raw_response = NULL, payload_pruned_at = $4
    WHERE id IN (SELECT id FROM chunk
                 WHERE status IN ('SUCCEEDED', 'FAILED') AND finished_at < $2)
      AND status IN ('SUCCEEDED', 'FAILED')
    RETURNING 1
)
SELECT (SELECT count(*) FROM cleared) AS done, (SELECT max(id) FROM chunk) AS last_id,
       (SELECT min(created_at) FROM chunk) AS oldest;

-- name: table_sizes
-- $1 table names; per table: estimated rows (the planner's, summed over partitions) and bytes
-- on disk with indexes and TOAST (summed over partitions).
SELECT t.name,
       (SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::float8
        FROM pg_partition_tree(t.name::regclass) p JOIN pg_class c ON c.oid = p.relid
        WHERE p.isleaf) AS estimated_rows,
       (SELECT coalesce(sum(pg_total_relation_size(p.relid)), 0)::float8
        FROM pg_partition_tree(t.name::regclass) p
        WHERE p.isleaf) AS bytes
FROM unnest($1::text[]) AS t(name)
ORDER BY t.name;

-- name: oldest_telemetry_day
-- no parameters; the oldest UTC day holding telemetry, or null.
SELECT telemetry_oldest_day();

-- name: prune_stream_tickets
-- $1 batch; stream tickets that expired (used or not): no node accepts them any more. Their
-- expiry is on the database clock, and so is this.
WITH doomed AS (
    SELECT digest FROM stream_ticket WHERE expires_at < now() LIMIT $1
), gone AS (
    DELETE FROM stream_ticket t USING doomed d WHERE t.digest = d.digest
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_command_hearing
-- $1 cut-off, $2 batch; the command_hearing rows of nodes that have not passed since the
-- cut-off: retired nodes, or ids gone for good (containers with generated ids). Such a row
-- stopped counting a minute after its node's last pass (COMMAND_HEARING_LIVE_S); it used to
-- stay for ever, and a fleet whose node ids change grew the table without bound. A node that
-- passes again writes its row anew (record_hearing inserts it). A row a node's reaper pass is
-- writing now is skipped (that pass makes it new).
WITH doomed AS (
    SELECT node_id FROM command_hearing WHERE passed_at < $1 LIMIT $2
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM command_hearing h USING doomed d
    WHERE h.node_id = d.node_id AND h.passed_at < $1
    RETURNING 1
)
SELECT count(*) FROM gone;
