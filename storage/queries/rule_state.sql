-- name: create_states
-- $1 device ids, $2 rule keys, $3 rule versions (each a text of lines, storage.sql.lines;
-- pairwise, sorted by device then rule); creates the rows not seen yet. Existing rows are
-- left alone: locking them is lock_states' job, which writes no tuple for it (DO UPDATE
-- would write each row twice per batch). Every node inserts in this one order, so two
-- batches wait, never deadlock.
INSERT INTO rule_state (device_id, rule_key, rule_version)
SELECT d, r, v
FROM unnest(string_to_array($1, E'\n'), string_to_array($2, E'\n'), string_to_array($3, E'\n'))
     WITH ORDINALITY AS u(d, r, v, n)
ORDER BY n
ON CONFLICT (device_id, rule_key) DO NOTHING;

-- name: lock_states
-- $1 device ids, $2 rule keys, $3 what the caller holds of each row (a token
-- "version.xmin@server", or an empty line: nothing), each a text of lines (storage.sql.lines;
-- pairwise); every row, locked until the transaction ends, in the same fixed order (device,
-- then rule). Each row answers its key's position in $1 (from 1), its version and xmin (the
-- transaction that wrote it, with the server's start time: after a failover or a
-- point-in-time restore, transaction ids lost with the old timeline are issued again, so an
-- xmin names one write only within one run of one server), and whether the caller's token is
-- the row's own: then the caller holds the row as it is and the other columns are NULL (not
-- sent, not decoded); otherwise they follow in `RuleStateRow` order (after its keys and
-- version). A row updated while this one waited for its lock is answered as that update
-- left it.
WITH server AS (  -- the server's start time, once a statement (microseconds, as text)
    SELECT (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint::text AS started
)
SELECT l.n, l.version, l.xmin, l.hit,
       CASE WHEN l.hit THEN NULL ELSE l.rule_version END AS rule_version,
       CASE WHEN l.hit THEN NULL ELSE l.firing END AS firing,
       CASE WHEN l.hit THEN NULL ELSE l.pending_count END AS pending_count,
       CASE WHEN l.hit THEN NULL ELSE l.pending_since END AS pending_since,
       CASE WHEN l.hit THEN NULL ELSE l.last_ts END AS last_ts,
       CASE WHEN l.hit THEN NULL ELSE l.last_seq END AS last_seq,
       CASE WHEN l.hit THEN NULL ELSE l.fired_ts END AS fired_ts,
       CASE WHEN l.hit THEN NULL ELSE l.fired_event_id END AS fired_event_id,
       CASE WHEN l.hit THEN NULL ELSE l.released_ts END AS released_ts,
       CASE WHEN l.hit THEN NULL ELSE l.clear_ts END AS clear_ts,
       CASE WHEN l.hit THEN NULL ELSE l.clear_event_id END AS clear_event_id,
       CASE WHEN l.hit THEN NULL ELSE l.violating_ts END AS violating_ts,
       CASE WHEN l.hit THEN NULL ELSE l.last_device_ts END AS last_device_ts
FROM (
    -- Not flattened into the outer query (it locks): `hit` is computed once a row.
    SELECT u.n::int4 AS n, s.version, s.rule_version, s.firing, s.pending_count,
           s.pending_since, s.last_ts, s.last_seq, s.fired_ts, s.fired_event_id, s.released_ts,
           s.clear_ts, s.clear_event_id, s.violating_ts, s.last_device_ts,
           s.xmin::text || '@' || (SELECT started FROM server) AS xmin,
           u.t = s.version::text || '.' || s.xmin::text || '@' || (SELECT started FROM server)
               AS hit
    FROM rule_state s
    JOIN unnest(string_to_array($1, E'\n'), string_to_array($2, E'\n'),
                string_to_array($3, E'\n')) WITH ORDINALITY AS u(d, r, t, n)
      ON s.device_id = u.d AND s.rule_key = u.r
    ORDER BY s.device_id, s.rule_key
    FOR UPDATE OF s
) l;

-- name: write_states
-- $1 the rows (rule_state_write_us2[], migration 0041: device id, rule key, the version read,
-- then the state's columns, times as microseconds since 1970-01-01T00:00:00Z), $2 node id;
-- each write conditional on the version read. Times come back exactly (from_micros,
-- migration 0034).
-- $3 device ids, $4 rule keys, $5 tokens (each a text of lines, storage.sql.lines; pairwise,
-- sorted by device then rule), $6 how many: empty and 0 when the caller holds the rows under
-- lock_states' lock. When it judged them from the rows it holds, with no lock taken first:
-- every row the batch touches, with the token it was held with. Every such row whose token
-- is still its own is locked, in lock_states' order (so a node doing this and one doing
-- lock_states wait, never deadlock; a row another transaction is writing is waited for, then
-- judged as it left it), and only when all $6 are, $1 and $7-$15 are written (`complete`);
-- else nothing is, and the caller reads the rows with lock_states (those locked here stay
-- locked).
-- $7-$15 the moved rows (storage.rule_state.write_states): rows none of whose columns but
-- the six a sample moves changed, a column each as a text of lines, an empty line NULL (a
-- column of NULLs only may come as one empty text: unnest pads a shorter array with NULLs):
-- device ids, rule keys, the versions read, then last_ts, last_seq, clear_ts, clear_event_id,
-- violating_ts, last_device_ts (times as microseconds). Most rows of a batch are these; sent as an array of
-- records each cost asyncpg Python checks of its own (measured on 500 rows: the client's CPU
-- 3.6-3.8 µs a row against 2.1-2.5, the statement's wall time alike).
-- Answers `complete`, how many rows were written of both (fewer than sent: someone else
-- wrote), and the writing transaction's id as the rows' xmin shows it (its low 32 bits),
-- with the server's start time, as lock_states answers it: with each row's new version, the
-- token lock_states compares.
WITH server AS (  -- the server's start time, once a statement (microseconds, as text)
    SELECT (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint::text AS started
), held AS (
    SELECT 1
    FROM rule_state s
    JOIN unnest(string_to_array($3, E'\n'), string_to_array($4, E'\n'),
                string_to_array($5, E'\n')) AS u(d, r, t)
      ON s.device_id = u.d AND s.rule_key = u.r
    WHERE u.t = s.version::text || '.' || s.xmin::text || '@' || (SELECT started FROM server)
    ORDER BY s.device_id, s.rule_key
    FOR UPDATE OF s
), complete AS (
    SELECT count(*) = $6 AS ok FROM held
), written AS (
    UPDATE rule_state s
    SET rule_version = u.rule_version, firing = u.firing, pending_count = u.pending_count,
        pending_since = from_micros(u.pending_since),
        last_ts = from_micros(u.last_ts),
        last_seq = u.last_seq,
        fired_ts = from_micros(u.fired_ts),
        fired_event_id = u.fired_event_id,
        released_ts = from_micros(u.released_ts),
        clear_ts = from_micros(u.clear_ts),
        clear_event_id = u.clear_event_id,
        violating_ts = from_micros(u.violating_ts),
        last_device_ts = from_micros(u.last_device_ts),
        version = s.version + 1, updated_at = now(), node_id = $2
    FROM unnest($1::rule_state_write_us2[]) AS u
    WHERE s.device_id = u.device_id AND s.rule_key = u.rule_key AND s.version = u.version
      AND (SELECT ok FROM complete)
    RETURNING 1
), moved AS (
    UPDATE rule_state s
    SET last_ts = from_micros(u.last_ts::bigint),
        last_seq = u.last_seq::bigint,
        clear_ts = from_micros(u.clear_ts::bigint),
        clear_event_id = u.clear_event_id,
        violating_ts = from_micros(u.violating_ts::bigint),
        last_device_ts = from_micros(u.last_device_ts::bigint),
        version = s.version + 1, updated_at = now(), node_id = $2
    FROM unnest(string_to_array($7, E'\n'), string_to_array($8, E'\n'),
                string_to_array($9, E'\n'), string_to_array($10, E'\n', ''),
                string_to_array($11, E'\n', ''), string_to_array($12, E'\n', ''),
                string_to_array($13, E'\n', ''), string_to_array($14, E'\n', ''),
                string_to_array($15, E'\n', ''))
         AS u(device_id, rule_key, version, last_ts, last_seq, clear_ts, clear_event_id,
              violating_ts, last_device_ts)
    WHERE s.device_id = u.device_id AND s.rule_key = u.rule_key
      AND s.version = u.version::bigint
      AND (SELECT ok FROM complete)
    RETURNING 1
)
SELECT (SELECT ok FROM complete) AS complete,
       (SELECT count(*) FROM written) + (SELECT count(*) FROM moved) AS written,
       (txid_current() & 4294967295)::text || '@' || (SELECT started FROM server) AS xmin;

-- name: drop_removed
-- $1 the rule keys this node runs now (event and threshold rules), $2 seconds within which
-- another node's heartbeat makes it live; deletes the state of every rule neither this node
-- nor any live node runs, and returns how many rows went.
WITH live AS (
    SELECT DISTINCT unnest(n.rule_keys) AS rule_key
    FROM node_rule_set n
    WHERE n.heartbeat_at > now() - make_interval(secs => $2)
), gone AS (
    DELETE FROM rule_state s
    WHERE NOT (s.rule_key = ANY ($1::text[]))
      AND NOT EXISTS (SELECT 1 FROM live WHERE live.rule_key = s.rule_key)
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: registered_keys
-- $1 node id; the rule keys its last registration recorded (its previous life's, read at its
-- start before it registers again) and its heartbeat then, or no row (never registered: a
-- new node id).
SELECT rule_keys, heartbeat_at FROM node_rule_set WHERE node_id = $1;

-- name: drop_leftovers
-- $1 rule keys a node has just taken up (a reload added them, or it started with rules its
-- last registration did not run), $2 seconds within which a heartbeat makes a node live, $3
-- its node id, $4 its last heartbeat before (null: none); deletes their state unless another
-- live node runs them, or this node wrote it since that heartbeat (its batches judge the rule
-- from the reload's swap on, a moment before it is recorded here): rows nobody has kept
-- up to date (a reload dropped a rule's state only once no live node ran it, so a node that
-- still ran it when the rule was removed, then stopped for good, left them behind), which
-- would otherwise stand for the rule taken up again (a hold pending from weeks ago fired at
-- once, a row firing then raised nothing for a new violation). How many rows went.
WITH gone AS (
    DELETE FROM rule_state s
    WHERE s.rule_key = ANY ($1::text[])
      AND NOT EXISTS (
          SELECT 1 FROM node_rule_set n
          WHERE n.node_id <> $3 AND n.heartbeat_at > now() - make_interval(secs => $2)
            AND s.rule_key = ANY (n.rule_keys))
      AND (s.node_id IS DISTINCT FROM $3 OR s.updated_at < $4::timestamptz)
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: device_page
-- $1 device id to page after, $2 how many; the devices' ids in order (the devices a rule a
-- node has just taken up may select: seed_added).
SELECT device_id FROM device WHERE device_id > $1 ORDER BY device_id LIMIT $2;

-- name: seed_added
-- $1 device ids, $2 rule keys, $3 metrics (arrays, pairwise, sorted by device then rule:
-- threshold rules a node has just taken up, and the devices each
-- selects), $4 how many of each device's newest stored samples are looked at, $5 seconds
-- ahead of its receipt past which a sample is judged at its receipt ([alarms]
-- max_future_skew_s), $6 node id, $7 the rule version that says "under no definition" (no
-- node runs it: storage.rule_state.ADDED); creates the row of each pair whose device has a
-- sample of the metric among those, under no definition, its
-- ordering facts those of that sample as a batch would have judged it first (its own time,
-- or its receipt when dated past the bound ahead): the hold timer then judges it under the
-- rule from that sample (stale_rows, AlarmEngine.rejudge_stale_rows), as it judges a row a
-- reload changed. A device that reports by exception sends nothing more to judge. Existing
-- rows are left alone (a batch judged a sample first). How many rows were created.
WITH seeded AS (
    INSERT INTO rule_state (device_id, rule_key, rule_version, last_ts, last_seq,
                            last_device_ts, node_id)
    SELECT u.d, u.r, $7,
           CASE WHEN t.ahead THEN t.received_at ELSE t.ts END, t.seq,
           CASE WHEN t.ahead THEN t.ts END, $6
    FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(d, r, m, n)
    CROSS JOIN LATERAL (
        SELECT s.ts, s.seq, s.received_at,
               s.ts > s.received_at + make_interval(secs => $5) AS ahead
        FROM (
            SELECT ts, seq, received_at, metrics FROM telemetry
            WHERE device_id = u.d
            ORDER BY ts DESC, seq DESC NULLS LAST
            LIMIT $4
        ) s
        WHERE s.metrics ? u.m
        ORDER BY s.ts DESC, s.seq DESC NULLS LAST
        LIMIT 1
    ) t
    ORDER BY u.n
    ON CONFLICT (device_id, rule_key) DO NOTHING
    RETURNING 1
)
SELECT count(*) FROM seeded;

-- name: register_rule_set
-- $1 node id, $2 the rule keys it runs (event and threshold rules), $3 their definitions
-- (rule_version, pairwise); its heartbeat, now. A heartbeat never moves back (a delayed write
-- of the node's own is refused).
INSERT INTO node_rule_set (node_id, rule_keys, rule_versions)
VALUES ($1, $2::text[], $3::text[])
ON CONFLICT (node_id) DO UPDATE
SET rule_keys = EXCLUDED.rule_keys,
    rule_versions = EXCLUDED.rule_versions,
    heartbeat_at = EXCLUDED.heartbeat_at,
    registered_at = CASE WHEN node_rule_set.rule_keys = EXCLUDED.rule_keys
                         THEN node_rule_set.registered_at ELSE EXCLUDED.registered_at END
WHERE node_rule_set.heartbeat_at <= EXCLUDED.heartbeat_at;

-- name: live_rule_sets
-- $1 seconds within which a heartbeat makes a node live; node id and rule keys of each.
SELECT node_id, rule_keys FROM node_rule_set
WHERE heartbeat_at > now() - make_interval(secs => $1)
ORDER BY node_id;

-- name: get_state
-- $1 device id, $2 rule key; one row as it is (for tests and the operator).
SELECT * FROM rule_state WHERE device_id = $1 AND rule_key = $2;

-- name: due_holds
-- $1 rule keys, $2 rule versions, $3 for_seconds, $4 for_samples (arrays, pairwise: this
-- node's threshold rules with a hold), $5 now (database time), $6 device id and $7 rule key
-- to page after, $8 how many; the pending rows whose hold has passed by $5 with no further
-- sample: on the row's timeline, device time to the newest sample (pending_since to last_ts),
-- then database time since that sample's batch wrote the row (updated_at). Columns in
-- `RuleStateRow` order, then updated_at. Locked until the transaction ends; a row an ingest
-- batch (or another node's timer) holds is skipped, not waited for: the next pass sees it as
-- that transaction left it. A row written meanwhile is judged again as committed (FOR UPDATE
-- re-checks the conditions on the newest version). Reads rule_state_pending_idx only.
SELECT s.device_id, s.rule_key, s.version, s.rule_version, s.firing, s.pending_count,
       s.pending_since, s.last_ts, s.last_seq, s.fired_ts, s.fired_event_id, s.released_ts,
       s.clear_ts, s.clear_event_id, s.violating_ts, s.last_device_ts, s.updated_at
FROM rule_state s
JOIN unnest($1::text[], $2::text[], $3::float8[], $4::integer[]) AS u(r, v, secs, n)
    ON s.rule_key = u.r
WHERE s.pending_count > 0
  AND NOT s.firing
  AND s.rule_version = u.v
  AND s.pending_count >= u.n
  AND s.updated_at + (s.pending_since - s.last_ts) + make_interval(secs => u.secs) <= $5
  AND (s.device_id, s.rule_key) > ($6::text, $7::text)
ORDER BY s.device_id, s.rule_key
LIMIT $8
FOR UPDATE OF s SKIP LOCKED;

-- name: stale_holds
-- $1 rule keys, $2 rule versions (arrays, pairwise: this node's threshold rules with a hold),
-- $3 seconds within which a heartbeat makes a node live, $4 this node's id, $5 device id and
-- $6 rule key to page after, $7 how many; the pending rows of these rules written under
-- another definition that no other live node runs (node_rule_set.rule_versions, migration
-- 0042): a rule a reload changed while its hold was pending. Columns in `RuleStateRow` order.
-- Locked until the transaction ends; a row another transaction holds is skipped (the next
-- pass sees it as that one left it: an ingest batch brought it to this definition, or another
-- node's timer judged it again). Reads rule_state_pending_idx only.
WITH live AS (
    SELECT k.rule_key, k.rule_version
    FROM node_rule_set n
    CROSS JOIN LATERAL unnest(n.rule_keys, n.rule_versions) AS k(rule_key, rule_version)
    WHERE n.heartbeat_at > now() - make_interval(secs => $3) AND n.node_id <> $4
)
SELECT s.device_id, s.rule_key, s.version, s.rule_version, s.firing, s.pending_count,
       s.pending_since, s.last_ts, s.last_seq, s.fired_ts, s.fired_event_id, s.released_ts,
       s.clear_ts, s.clear_event_id, s.violating_ts, s.last_device_ts
FROM rule_state s
JOIN unnest($1::text[], $2::text[]) AS u(r, v) ON s.rule_key = u.r
WHERE s.pending_count > 0
  AND NOT s.firing
  AND s.rule_version <> u.v
  AND NOT EXISTS (
      SELECT 1 FROM live WHERE live.rule_key = s.rule_key AND live.rule_version = s.rule_version
  )
  AND (s.device_id, s.rule_key) > ($5::text, $6::text)
ORDER BY s.device_id, s.rule_key
LIMIT $7
FOR UPDATE OF s SKIP LOCKED;

-- name: write_rejudged
-- $1 device ids, $2 rule keys, $3 the versions read, $4 the rule versions now, $5 pending
-- counts, $6 pending_since (arrays, pairwise), $7 node id; the rows the hold timer judged
-- again under another definition (stale_holds), each conditional on the version read, under
-- its lock. Only the definition and the pending run change; `updated_at` is kept: it is the
-- hold's clock (the database time of the newest sample's batch, due_holds), which judging
-- the same samples again does not move. How many rows were written.
WITH written AS (
    UPDATE rule_state s
    SET rule_version = u.rule_version, pending_count = u.pending_count,
        pending_since = u.pending_since, version = s.version + 1, node_id = $7
    FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::integer[],
                $6::timestamptz[]) AS u(device_id, rule_key, version, rule_version,
                                        pending_count, pending_since)
    WHERE s.device_id = u.device_id AND s.rule_key = u.rule_key AND s.version = u.version
    RETURNING 1
)
SELECT count(*) FROM written;

-- name: stale_rows
-- $1 rule keys, $2 rule versions, $3 whether each holds time (for_seconds > 0) (arrays,
-- pairwise: this node's threshold rules), $4 seconds within which a heartbeat makes a node
-- live, $5 this node's id, $6 device id and $7 rule key to page after, $8 how many; the keys
-- of the rows of these rules written under another definition that no other live node runs
-- (a reload changed the rule): firing and normal rows, and pending rows of rules that hold
-- no time (the pending holds are stale_holds'). Not locked: lock_stale_rows locks them; a
-- key here and not there was skipped (another transaction holds it) or judged meanwhile.
-- No index has rule_version (none may slow the ingest's writes): this reads every row of
-- these rules, so the hold timer runs it only after a rule set changed (this node's reload
-- or start, another live node's), until a pass has judged every row it found.
WITH live AS (
    SELECT k.rule_key, k.rule_version
    FROM node_rule_set n
    CROSS JOIN LATERAL unnest(n.rule_keys, n.rule_versions) AS k(rule_key, rule_version)
    WHERE n.heartbeat_at > now() - make_interval(secs => $4) AND n.node_id <> $5
)
SELECT s.device_id, s.rule_key
FROM rule_state s
JOIN unnest($1::text[], $2::text[], $3::boolean[]) AS u(r, v, hold) ON s.rule_key = u.r
WHERE s.rule_version <> u.v
  AND NOT (u.hold AND s.pending_count > 0)
  AND NOT EXISTS (
      SELECT 1 FROM live WHERE live.rule_key = s.rule_key AND live.rule_version = s.rule_version
  )
  AND (s.device_id, s.rule_key) > ($6::text, $7::text)
ORDER BY s.device_id, s.rule_key
LIMIT $8;

-- name: lock_stale_rows
-- $1 device ids, $2 rule keys (stale_rows' page), then $3-$7 as stale_rows' $1-$5; those of
-- the rows that are still stale as stale_rows says, locked until the transaction ends, in
-- (device, rule) order; a row another transaction holds (an ingest batch, another node's
-- timer) is skipped, not waited for. A row written meanwhile is judged again as committed
-- (FOR UPDATE re-checks the conditions on the newest version). Columns in `RuleStateRow`
-- order.
WITH live AS (
    SELECT k.rule_key, k.rule_version
    FROM node_rule_set n
    CROSS JOIN LATERAL unnest(n.rule_keys, n.rule_versions) AS k(rule_key, rule_version)
    WHERE n.heartbeat_at > now() - make_interval(secs => $6) AND n.node_id <> $7
)
SELECT s.device_id, s.rule_key, s.version, s.rule_version, s.firing, s.pending_count,
       s.pending_since, s.last_ts, s.last_seq, s.fired_ts, s.fired_event_id, s.released_ts,
       s.clear_ts, s.clear_event_id, s.violating_ts, s.last_device_ts
FROM rule_state s
JOIN unnest($1::text[], $2::text[]) AS p(d, r) ON s.device_id = p.d AND s.rule_key = p.r
JOIN unnest($3::text[], $4::text[], $5::boolean[]) AS u(r, v, hold) ON s.rule_key = u.r
WHERE s.rule_version <> u.v
  AND NOT (u.hold AND s.pending_count > 0)
  AND NOT EXISTS (
      SELECT 1 FROM live WHERE live.rule_key = s.rule_key AND live.rule_version = s.rule_version
  )
ORDER BY s.device_id, s.rule_key
FOR UPDATE OF s SKIP LOCKED;

-- name: live_definitions
-- $1 seconds within which a heartbeat makes a node live, $2 this node's id; each other live
-- node's rule keys and their definitions (rule_version), pairwise: what it runs. The hold
-- timer judges the rows of a definition no live node runs again once this changes.
SELECT node_id, rule_keys, rule_versions FROM node_rule_set
WHERE heartbeat_at > now() - make_interval(secs => $1) AND node_id <> $2
ORDER BY node_id;
