-- name: create_nodes
-- $1 group ids, $2 edge node ids (pairwise, sorted); creates the rows not seen yet, in one
-- order on every node (two batches wait for each other, never deadlock).
INSERT INTO sparkplug_node (group_id, edge_node_id)
SELECT g, n FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(g, n, o)
ORDER BY o
ON CONFLICT (group_id, edge_node_id) DO NOTHING;

-- name: lock_nodes
-- $1 group ids, $2 edge node ids, $3 the births the caller holds of each (a token
-- "births_version@server start", or an empty text: none) (pairwise); every row, locked until
-- the transaction ends, in key order, columns in `NodeRow` order. The aliases and metric
-- datatypes come as text only where the caller's token is not the row's own (NULL where it
-- holds them as they are); `births` is the row's token. The server's start time is in it as
-- in rule_state.sql's tokens: after a failover or a restore, a version may be reached again
-- with other births. A row updated while this one waited for its lock is answered as that
-- update left it.
WITH server AS (  -- the server's start time, once a statement (microseconds, as text)
    SELECT (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint::text AS started
)
SELECT l.group_id, l.edge_node_id, l.born, l.bdseq, l.seq, l.missing, l.trusted,
       CASE WHEN l.held THEN NULL ELSE l.aliases::text END AS aliases,
       CASE WHEN l.held THEN NULL ELSE l.metrics::text END AS metrics,
       l.devices, l.recent, l.rebirth_reason, l.rebirth_wanted, l.births, l.dead_bdseq,
       l.unborn, l.device_marks, l.birth_ts, l.born_epoch, l.device_lives
FROM (
    -- Not flattened into the outer query (it locks): `births` is computed once a row.
    SELECT s.group_id, s.edge_node_id, s.born, s.bdseq, s.seq, s.missing::text AS missing,
           s.trusted, s.aliases, s.metrics, s.devices, s.recent, s.rebirth_reason,
           s.rebirth_wanted_at IS NOT NULL AS rebirth_wanted,
           s.births_version::text || '@' || (SELECT started FROM server) AS births,
           u.t = s.births_version::text || '@' || (SELECT started FROM server) AS held,
           s.dead_bdseq, s.unborn, s.device_marks::text AS device_marks, s.birth_ts,
           extract(epoch FROM s.born_at)::double precision AS born_epoch,
           s.device_lives::text AS device_lives
    FROM sparkplug_node s
    JOIN unnest($1::text[], $2::text[], $3::text[]) AS u(g, n, t)
      ON s.group_id = u.g AND s.edge_node_id = u.n
    ORDER BY s.group_id, s.edge_node_id
    FOR UPDATE OF s
) l;

-- name: write_nodes
-- Each edge node's stream state, every node of the batch in one statement (rows locked by
-- lock_nodes in this transaction): $1 group ids, $2 edge node ids, $6 missing (json), $8
-- devices and $9 recent ids (each node's joined by `,`, which neither ids nor hex hold), each a
-- text of lines (storage.sql.lines), pairwise with $3 born, $4 bdseq, $5 seq, $7 trusted, $10
-- rebirth reasons (null: none wanted), $11 born now (a birth was taken in this batch), $12 the
-- bdSeq of a death taken before its session's birth (null: none; migration 0040), $13 the
-- devices of the session before that no DBIRTH has born since its NBIRTH (joined by `,` as
-- $8; migration 0050), $14 each device's latest birth or death seq taken while a seq before it
-- was missing (json; migration 0059), $15 the payload timestamps of the NBIRTHs in force
-- (migration 0061), $16 each device's latest life taken while a seq before it was missing
-- (json; migration 0062). The
-- births (aliases, metric datatypes) are left as they are: write_births writes those a birth
-- of the batch changed.
UPDATE sparkplug_node s
SET born = u.born, bdseq = u.bdseq, seq = u.seq, missing = u.missing::jsonb,
    trusted = u.trusted,
    devices = coalesce(string_to_array(nullif(u.devices, ''), ','), '{}'),
    recent = coalesce(string_to_array(nullif(u.recent, ''), ','), '{}'),
    rebirth_reason = u.reason,
    rebirth_wanted_at = CASE WHEN u.reason IS NULL THEN NULL
                             ELSE coalesce(s.rebirth_wanted_at, now()) END,
    rebirth_sent_at = CASE WHEN u.reason IS NULL THEN NULL ELSE s.rebirth_sent_at END,
    born_at = CASE WHEN u.born_now THEN now() ELSE s.born_at END,
    dead_bdseq = u.dead_bdseq,
    unborn = coalesce(string_to_array(nullif(u.unborn, ''), ','), '{}'),
    device_marks = u.marks::jsonb,
    birth_ts = u.birth_ts,
    device_lives = u.lives::jsonb,
    updated_at = now()
FROM unnest(string_to_array($1, E'\n'), string_to_array($2, E'\n'), $3::boolean[],
            $4::bigint[], $5::integer[], string_to_array($6, E'\n'), $7::boolean[],
            string_to_array($8, E'\n'), string_to_array($9, E'\n'), $10::text[],
            $11::boolean[], $12::bigint[], string_to_array($13, E'\n'),
            string_to_array($14, E'\n'), $15::bigint[], string_to_array($16, E'\n'))
     AS u(g, n, born, bdseq, seq, missing, trusted, devices, recent, reason, born_now,
          dead_bdseq, unborn, marks, birth_ts, lives)
WHERE s.group_id = u.g AND s.edge_node_id = u.n;

-- name: write_births
-- $1 group id, $2 edge node id, $3 aliases (json), $4 metric datatypes (json): after
-- write_nodes, for a node whose births the batch changed (an NBIRTH, a DBIRTH; rare beside
-- its data). Naming them moves births_version by one (migration 0039's trigger).
UPDATE sparkplug_node SET aliases = $3::jsonb, metrics = $4::jsonb
WHERE group_id = $1 AND edge_node_id = $2;

-- name: take_rebirths
-- $1 seconds before an unanswered request is sent again, $2 most rows; the edge nodes whose
-- rebirth request is due, locked (SKIP LOCKED: another node's pass takes the others) and marked
-- sent. The caller publishes after its commit: a crash between the two loses one request,
-- which the retry interval sends again.
UPDATE sparkplug_node s
SET rebirth_sent_at = now(), rebirth_requests = s.rebirth_requests + 1
FROM (
    SELECT group_id, edge_node_id FROM sparkplug_node
    WHERE rebirth_wanted_at IS NOT NULL
      AND (rebirth_sent_at IS NULL OR rebirth_sent_at < now() - make_interval(secs => $1))
    ORDER BY rebirth_wanted_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
) due
WHERE s.group_id = due.group_id AND s.edge_node_id = due.edge_node_id
RETURNING s.group_id, s.edge_node_id, s.rebirth_reason;

-- name: take_unborn
-- $1 seconds after an NBIRTH by which its session's DBIRTHs are over (a grace: Sparkplug sends
-- them right after it), $2 most rows; the edge nodes whose devices of the session before were
-- not born again within it, locked (SKIP LOCKED: a batch holding one judges it, another
-- node's pass takes it) and emptied. Returns them with those devices, less those born since
-- (a node of the previous release took their DBIRTH and left `unborn` as it was): the caller
-- sets them offline in the same transaction.
UPDATE sparkplug_node s
SET unborn = '{}', updated_at = now()
FROM (
    SELECT group_id, edge_node_id,
           ARRAY(SELECT unnest(unborn) EXCEPT SELECT unnest(devices) ORDER BY 1) AS gone
    FROM sparkplug_node
    WHERE unborn <> '{}' AND born_at < now() - make_interval(secs => $1)
    ORDER BY group_id, edge_node_id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
) due
WHERE s.group_id = due.group_id AND s.edge_node_id = due.edge_node_id
RETURNING s.group_id, s.edge_node_id, due.gone;

-- name: expire_missing
-- $1 reorder window (seconds); edge nodes whose oldest missing seq has been missing longer than
-- it: untrusted, a rebirth wanted; the devices' marks and lives taken meanwhile dropped with
-- the missing seqs (no message is late now: migrations 0059, 0062). A mark left here outlived
-- the window it is read in (seq order against the node's seq): once seqs went missing again and
-- the stream came round a cycle, a late birth or death was judged "overtaken" by it. Returns them.
UPDATE sparkplug_node s
SET trusted = false, missing = '{}'::jsonb, device_marks = '{}'::jsonb,
    device_lives = '{}'::jsonb,
    rebirth_reason = coalesce(s.rebirth_reason, 'seq gap'),
    rebirth_wanted_at = coalesce(s.rebirth_wanted_at, now()),
    updated_at = now()
WHERE s.born AND s.missing <> '{}'::jsonb
  AND EXISTS (
      SELECT 1 FROM jsonb_each_text(s.missing) AS m(k, v)
      WHERE v::double precision < extract(epoch FROM now()) - $1
  )
RETURNING s.group_id, s.edge_node_id;

-- name: get_node
-- $1 group id, $2 edge node id; one edge node's state for the API and tests.
SELECT group_id, edge_node_id, born, bdseq, seq, trusted, aliases::text, metrics::text, devices,
       rebirth_reason, rebirth_wanted_at, rebirth_sent_at, rebirth_requests, born_at
FROM sparkplug_node WHERE group_id = $1 AND edge_node_id = $2;

-- name: db_epoch
-- no parameters; the database's now as epoch seconds (the clock every node shares).
SELECT extract(epoch FROM now())::double precision;

-- name: metric_definition
-- $1 group id, $2 edge node id, $3 device ('' for the node), $4 metric name; whether the node
-- and the device are born, and the metric's datatype (null: not in their births).
SELECT s.born AND ($3 = '' OR $3 = ANY (s.devices)) AS born,
       (s.metrics -> $3 ->> $4)::integer AS datatype
FROM sparkplug_node s WHERE s.group_id = $1 AND s.edge_node_id = $2;

-- name: open_writes
-- $1 device ids, $2 when the data that may confirm them was received (null: now); the open
-- (claimed or sent) commands of those Sparkplug devices claimed by then, oldest first. Data
-- received before the claim answers no write of it (a dead letter replayed: its receipt).
SELECT id, device_id, claim_generation, claimed_node_id, name, params::text
FROM command
WHERE device_id = ANY ($1::text[]) AND status IN ('CLAIMED', 'SENT')
  AND claimed_at <= coalesce($2::timestamptz, now())
ORDER BY id;
