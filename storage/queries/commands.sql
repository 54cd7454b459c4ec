-- name: get
-- $1 id.
SELECT * FROM command WHERE id = $1;

-- name: list_for_device
-- $1 device, $2 before id (keyset, newest first) or null, $3 limit.
SELECT * FROM command
WHERE device_id = $1 AND ($2::bigint IS NULL OR id < $2)
ORDER BY id DESC LIMIT $3;

-- name: list_for_device_of_status
-- $1 device, $2 status, $3 before id (keyset, newest first) or null, $4 limit.
SELECT * FROM command
WHERE device_id = $1 AND status = $2 AND ($3::bigint IS NULL OR id < $3)
ORDER BY id DESC LIMIT $4;

-- name: list_all
-- $1 before id (keyset, newest first) or null, $2 limit. The fleet's commands.
SELECT * FROM command WHERE ($1::bigint IS NULL OR id < $1) ORDER BY id DESC LIMIT $2;

-- The fleet's commands of one status: $1 status, $2 before id or null, $3 limit. One statement
-- per kind of status, each naming its statuses as constants: a prepared statement's generic plan
-- can then prove the partial index's predicate (a `status = $1` alone cannot), so a page of rare
-- statuses never walks the whole table (migration 0015).

-- name: list_of_status
-- Most commands end ACKED: the primary key, walked backwards, finds them at once.
SELECT * FROM command
WHERE status = $1 AND ($2::bigint IS NULL OR id < $2)
ORDER BY id DESC LIMIT $3;

-- name: list_pending
SELECT * FROM command
WHERE status = 'PENDING' AND status = $1 AND ($2::bigint IS NULL OR id < $2)
ORDER BY id DESC LIMIT $3;

-- name: list_in_flight
SELECT * FROM command
WHERE status IN ('CLAIMED', 'SENT') AND status = $1 AND ($2::bigint IS NULL OR id < $2)
ORDER BY id DESC LIMIT $3;

-- name: list_unsuccessful
SELECT * FROM command
WHERE status IN ('FAILED', 'TIMEOUT', 'CANCELLED') AND status = $1
  AND ($2::bigint IS NULL OR id < $2)
ORDER BY id DESC LIMIT $3;

-- name: receipts_of
-- $1 command id; every receipt, whatever its outcome, oldest first.
SELECT id, reported_command_id, claim_generation, node_id, result, result_code,
       raw_result_code, raw_ack, outcome, reason, received_by, received_at
FROM command_receipt WHERE command_id = $1 ORDER BY id;

-- name: plan_once
-- No parameters; in a claim's transaction, before `claim_due`: plan it once per connection
-- (a generic plan) instead of at every claim. Its plan does not depend on the parameters (the
-- same index walk whatever they are), and planning it cost 1.3-2.5 ms per claim, more than
-- running it; claims of a few commands each (single commands, one wake-up per receipt) paid
-- that every time, since PostgreSQL keeps re-planning a statement whose generic plan it
-- estimates dearer (the LIMIT parameter counts as a tenth of the table there).
SET LOCAL plan_cache_mode = force_generic_plan;

-- name: claim_due
-- $1 node id, $2 lease seconds, $3 batch size, $4 most commands in flight per device, $5 actor,
-- $6 the rollout clock (null: now(); tests pass explicit instants), $7 the names of the
-- [[ingest.mappings]] configured.
-- One statement: due PENDING commands, oldest first, never behind an older open command of
-- the same device (creation order) nor beyond the device's in-flight limit; deferrable ones
-- not to a device whose retained presence is offline. Generation + 1, this node, a lease; and
-- each claim's audit row (one round trip, like mark_sent).
-- A campaign with a rollout limit is a token bucket (per_minute / 60 tokens a second, at most
-- one second's worth held): its commands (paced) are looked for apart, at most as many as it
-- has whole tokens, and the claim spends one token per command it took. The buckets are
-- locked by this statement itself (see `buckets`), so a claim is one round trip.
WITH clock AS (
    SELECT coalesce($6::timestamptz, now()) AS t
), busy AS MATERIALIZED (
    -- Devices at their in-flight limit, counted once per claim (from the small partial index
    -- of CLAIMED and SENT rows), then looked up by hash for each pending command walked: a
    -- count per candidate cost 210 ms per claim with 1,000 devices busy and 9,000 queued.
    -- A device read through one of the mappings configured (device_mapping) sends no receipt:
    -- its SENT commands are done as far as the gateway can know (they stay SENT until
    -- sent_timeout_s, docs/devices.md), so only its CLAIMED ones are in flight. Counted, its
    -- first command held every later one PENDING for that day.
    -- The mappings are looked up once per device in flight, not per command: a claim with
    -- 20,000 commands SENT to 2,000 devices and 5,000 queued took 10 ms, as before; 50 per
    -- command.
    SELECT f.device_id FROM command f
    WHERE f.status IN ('CLAIMED', 'SENT')
    GROUP BY f.device_id
    HAVING count(*) FILTER (WHERE f.status = 'CLAIMED') >= $4
        OR (count(*) >= $4
            AND f.device_id NOT IN (SELECT m.device_id FROM device_mapping m
                                    WHERE m.mapping = ANY ($7::text[])))
), buckets AS (
    SELECT k.id, clock.t,
           least(greatest(1.0, k.per_minute / 60.0),
                 k.rollout_tokens
                 + greatest(0.0, extract(epoch FROM clock.t - k.rollout_at)::double precision)
                   * k.per_minute / 60.0) AS tokens
    FROM campaign k CROSS JOIN clock
    WHERE k.status = 'RUNNING' AND k.per_minute IS NOT NULL
    ORDER BY k.id
    -- Claims on every node take the buckets one at a time, in id order. Locking waits for a
    -- claim holding them, then reads the row that claim committed (PostgreSQL re-reads a row
    -- it locked after waiting), so no two claims spend the same tokens.
    FOR UPDATE OF k
), limited AS (
    SELECT l.id
    FROM buckets b
    CROSS JOIN LATERAL (
        SELECT c.id
        FROM command c
        LEFT JOIN device d ON d.device_id = c.device_id
        WHERE c.campaign_id = b.id
          AND c.status = 'PENDING'
          AND c.next_attempt_at <= now()
          AND c.expire_at > now()
          AND (c.delivery = 'realtime' OR d.presence IS DISTINCT FROM 'offline')
          AND c.device_id NOT IN (SELECT device_id FROM busy)
          AND NOT EXISTS (
              SELECT 1 FROM command p
              WHERE p.device_id = c.device_id AND p.id < c.id AND p.status = 'PENDING')
        ORDER BY c.id
        LIMIT least(floor(b.tokens)::integer, $3)
    ) AS l
), free AS (
    SELECT c.id
    FROM command c
    LEFT JOIN device d ON d.device_id = c.device_id
    WHERE c.status = 'PENDING'
      AND c.next_attempt_at <= now()
      AND c.expire_at > now()
      AND (c.delivery = 'realtime' OR d.presence IS DISTINCT FROM 'offline')
      AND NOT c.paced
      AND c.device_id NOT IN (SELECT device_id FROM busy)
      AND NOT EXISTS (
          SELECT 1 FROM command p
          WHERE p.device_id = c.device_id AND p.id < c.id AND p.status = 'PENDING')
    ORDER BY c.id
    LIMIT $3
    FOR UPDATE OF c SKIP LOCKED
), paced AS (
    SELECT c.id
    FROM limited l
    JOIN command c ON c.id = l.id
    WHERE c.status = 'PENDING'
    FOR UPDATE OF c SKIP LOCKED
), due AS (
    -- Both kinds, oldest first; a paced row locked but not taken here stays PENDING.
    SELECT id FROM (SELECT id FROM free UNION ALL SELECT id FROM paced) AS u
    ORDER BY id
    LIMIT $3
), claimed AS (
    UPDATE command c
    SET status = 'CLAIMED', claim_generation = c.claim_generation + 1, claimed_node_id = $1,
        claimed_at = now(), lease_expire_at = now() + make_interval(secs => $2),
        -- Not sent in this claim yet: an earlier claim's SENT times are not this one's.
        sent_at = NULL, timeout_at = NULL,
        legacy_claim = false, updated_at = now()
    FROM due
    WHERE c.id = due.id
    RETURNING c.*
), audit AS (
    INSERT INTO command_audit (command_id, actor, action, from_status, to_status,
                               claim_generation, node_id)
    SELECT id, $5, 'claim', 'PENDING', status, claim_generation, $1 FROM claimed
), spent AS (
    UPDATE campaign k
    SET rollout_tokens = b.tokens - (SELECT count(*) FROM claimed x WHERE x.campaign_id = k.id),
        rollout_at = greatest(k.rollout_at, b.t)
    FROM buckets b
    WHERE k.id = b.id
)
SELECT * FROM claimed;

-- name: mark_sent
-- $1 id, $2 generation, $3 node, $4 seconds until timeout_at, $5 actor, $6 the audit row's note
-- (null for a PUBACK); the broker's PUBACK of the downlink, or a downlink in doubt (written, the
-- session lost before its PUBACK: the broker may have it), with its audit row, in one statement
-- (one round trip, one row locked).
-- Guarded by generation, node and status: a reclaimed command is not ours any more.
WITH sent AS (
    UPDATE command
    SET status = 'SENT', sent_at = now(), timeout_at = now() + make_interval(secs => $4),
        lease_expire_at = NULL, updated_at = now()
    WHERE id = $1 AND claim_generation = $2 AND claimed_node_id = $3 AND status = 'CLAIMED'
    RETURNING *
), audit AS (
    INSERT INTO command_audit (command_id, actor, action, from_status, to_status,
                               claim_generation, node_id, note)
    SELECT id, $5, 'sent', 'CLAIMED', status, claim_generation, $3, $6::text FROM sent
)
SELECT * FROM sent;

-- name: claims_of
-- $1 ids, $2 generations (pairwise), $3 node. The status of each of these commands still held
-- by this claim (generation and node; a plain read, no lock): a downlink that waited at the
-- broker for its slot goes out only if its command is still CLAIMED (docs/commands.md). By id
-- alone, the status tested by the caller (as in mark_sent_many: a status on the table let
-- PostgreSQL read every command in flight through their partial index).
SELECT c.id, c.status
FROM command c
JOIN unnest($1::bigint[], $2::integer[]) AS u(id, gen) ON c.id = u.id
WHERE c.claim_generation = u.gen AND c.claimed_node_id = $3;

-- name: release_unsent
-- $1 id, $2 generation, $3 node, $4 actor, $5 note. A claim whose downlink was never published
-- because this node's broker session was down (or went down before the PUBACK): back to
-- PENDING at once, reclaim_count unchanged: no node went silent, the broker was away, and
-- counting it would raise `command-reclaims` for every command of a maintenance window. The
-- generation stays (the next claim increments it, as after a reclaim); the audit row says why.
-- Guarded like mark_sent: a claim that lapsed meanwhile is the reaper's, and counted there.
WITH released AS (
    UPDATE command
    SET status = 'PENDING', lease_expire_at = NULL, updated_at = now()
    WHERE id = $1 AND claim_generation = $2 AND claimed_node_id = $3 AND status = 'CLAIMED'
    RETURNING *
), audit AS (
    INSERT INTO command_audit (command_id, actor, action, from_status, to_status,
                               claim_generation, node_id, note)
    SELECT id, $4, 'release', 'CLAIMED', status, claim_generation, $3, $5 FROM released
)
SELECT id FROM released;

-- name: fail_unsendable
-- $1 id, $2 generation, $3 node, $4 code (raw_result_code), $5 reason (raw_ack). The broker can
-- never take the downlink (larger than its maximum packet size, or a topic or payload it
-- refuses for good): CLAIMED -> FAILED at once, whatever the delivery class (a retry would be
-- refused the same way). result FAILED with no standard result code (no device answered); the
-- node's code and reason in raw_result_code / raw_ack, as the ack window's own TIMEOUT does.
-- Guarded like mark_sent; the caller writes the audit row and the outbox event.
UPDATE command
SET status = 'FAILED', result = 'FAILED', result_code = NULL, raw_result_code = $4,
    raw_ack = $5, finished_at = now(), lease_expire_at = NULL, updated_at = now()
WHERE id = $1 AND claim_generation = $2 AND claimed_node_id = $3 AND status = 'CLAIMED'
RETURNING *;

-- name: apply_receipt
-- The four guards ($1 id, $2 generation, $3 node, status open) plus $4 the status the effect
-- was computed from; then $5 new status, $6 result, $7 result code, $8 raw result code,
-- $9 raw ack, $10 terminal, $11 retry (0/1), $12 retry delay seconds, $13 timeout seconds.
-- A SENT receipt on a CLAIMED command (the device answered before the dispatcher handled the
-- PUBACK) sends it as mark_sent would: this claim's sent_at and timeout_at, from now, never an
-- earlier claim's (the reaper judges the claim by them). On a SENT command it keeps them.
-- A SENT receipt on a SENT command whose claim has an accepted receipt already is a repeat
-- (a QoS 1 redelivery, a device answering twice): nothing is written, and it is judged
-- `duplicated` (it used to be accepted again, its raw fields written over the first's).
UPDATE command
SET status = $5, result = $6, result_code = $7, raw_result_code = $8, raw_ack = $9,
    finished_at = CASE WHEN $10::boolean THEN now() END,
    retry_count = retry_count + $11,
    next_attempt_at = CASE WHEN $11 = 1 THEN now() + make_interval(secs => $12)
                           ELSE next_attempt_at END,
    lease_expire_at = NULL,
    sent_at = CASE WHEN $4 = 'CLAIMED' AND $5 = 'SENT' THEN now() ELSE sent_at END,
    timeout_at = CASE WHEN $4 = 'CLAIMED' AND $5 = 'SENT'
                      THEN now() + make_interval(secs => $13)
                      ELSE timeout_at END,
    updated_at = now()
WHERE id = $1 AND claim_generation = $2 AND claimed_node_id = $3
  AND status IN ('CLAIMED', 'SENT') AND status = $4
  AND NOT ($4 = 'SENT' AND $5 = 'SENT'
           AND EXISTS (SELECT 1 FROM command_receipt r
                       WHERE r.command_id = command.id
                         AND r.claim_generation = command.claim_generation
                         AND r.node_id = command.claimed_node_id AND r.outcome = 'accepted'))
RETURNING *;

-- name: claim_answered
-- $1 command id, $2 generation, $3 node; whether a receipt of that claim was accepted (a PENDING
-- command then waits for the retry that answer asked for: its claim did not lapse).
SELECT EXISTS (SELECT 1 FROM command_receipt
               WHERE command_id = $1 AND claim_generation = $2 AND node_id = $3
                 AND outcome = 'accepted');

-- name: lock_command
-- $1 id; the command's row locked for the caller's transaction: waits for a transaction that
-- holds it (an earlier attempt of the same write, its COMMIT still under way) to end.
SELECT 1 FROM command WHERE id = $1 FOR UPDATE;

-- name: own_receipt_kept
-- $1 command id, $2 generation, $3 node (the claim's, which wrote the receipt itself), $4
-- result, $5 raw result code, $6 raw ack; whether that very receipt is kept: a retry of the
-- write whose COMMIT answer was lost finds what the earlier attempt committed.
SELECT EXISTS (SELECT 1 FROM command_receipt
               WHERE command_id = $1 AND claim_generation = $2 AND node_id = $3
                 AND received_by = $3 AND result = $4
                 AND raw_result_code IS NOT DISTINCT FROM $5
                 AND raw_ack IS NOT DISTINCT FROM $6);

-- name: insert_receipt
-- $1 command id or null, $2 reported command id, $3 device, $4 generation, $5 node,
-- $6 result, $7 result code, $8 raw result code, $9 raw ack, $10 outcome, $11 reason,
-- $12 receiving node.
INSERT INTO command_receipt (command_id, reported_command_id, device_id, claim_generation,
                             node_id, result, result_code, raw_result_code, raw_ack, outcome,
                             reason, received_by)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12);

-- name: insert_audit
-- $1 command id, $2 actor, $3 action, $4 from, $5 to, $6 generation, $7 node, $8 note.
INSERT INTO command_audit (command_id, actor, action, from_status, to_status,
                           claim_generation, node_id, note)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8);

-- name: reclaim_expired
-- no parameters; CLAIMED past its lease (the node went silent): back to PENDING,
-- reclaim_count + 1, generation unchanged (the next claim increments it).
UPDATE command
SET status = 'PENDING', reclaim_count = reclaim_count + 1, lease_expire_at = NULL,
    updated_at = now()
WHERE status = 'CLAIMED' AND lease_expire_at < now()
RETURNING *;

-- name: ack_window_passed
-- $1 ack window seconds (with the judging node's own lag), $2 the names of the
-- [[ingest.mappings]] configured, $3 the judging node, $4 the ack window seconds, $5 how
-- recently another node must have passed to count; SENT commands whose device gave no
-- receipt in time. A receipt another node of the $share group received and holds unstored
-- (its database away a moment, its writer lagging) is not missing: only commands sent an ack
-- window before every other live node's heard_through (command_hearing) are judged. A device read through one of those mappings
-- (device_mapping) gets its commands on the vendor's topic and sends no receipt at all: its
-- commands are left SENT (docs/devices.md#commands-to-mapped-devices). One whose mapping is
-- gone from the configuration gets the native downlink again, and is judged as any device.
-- A command whose device answered this claim already (a SENT receipt: "received, working on
-- it") has had its receipt: it waits for its outcome until timeout_at (fail_sent_timeout).
-- Locked for the pass, skipping rows another transaction holds: another node's reaper judging
-- them now (or a receipt being applied) is left to it. Waited for, that node's TIMEOUT was
-- written again here, kept as the device's `duplicated` answer.
SELECT * FROM command
WHERE status = 'SENT' AND sent_at < now() - make_interval(secs => $1)
  AND sent_at < (SELECT coalesce(min(h.heard_through), 'infinity')
                 FROM command_hearing h
                 WHERE h.node_id <> $3 AND h.passed_at > now() - make_interval(secs => $5))
                - make_interval(secs => $4)
  AND NOT EXISTS (SELECT 1 FROM device_mapping m
                  WHERE m.device_id = command.device_id AND m.mapping = ANY ($2::text[]))
  AND NOT EXISTS (SELECT 1 FROM command_receipt r
                  WHERE r.command_id = command.id
                    AND r.claim_generation = command.claim_generation
                    AND r.node_id = command.claimed_node_id AND r.outcome = 'accepted')
ORDER BY id LIMIT 500
FOR UPDATE SKIP LOCKED;

-- name: record_hearing
-- $1 node id, $2 seconds since the oldest message the node holds unstored was received, or
-- since its broker session last heard what the broker held for it, whichever is longer (0:
-- neither): up to when the node has stored what it received, written by each reaper pass.
INSERT INTO command_hearing (node_id, heard_through, passed_at)
VALUES ($1, now() - make_interval(secs => $2), now())
ON CONFLICT (node_id) DO UPDATE
SET heard_through = excluded.heard_through, passed_at = excluded.passed_at;

-- name: fail_sent_timeout
-- no parameters; SENT past timeout_at: FAILED.
UPDATE command
SET status = 'FAILED', result = 'TIMEOUT', finished_at = now(), updated_at = now()
WHERE status = 'SENT' AND timeout_at < now()
RETURNING *;

-- name: expire
-- no parameters; open commands past expire_at: TIMEOUT (with the status each one left).
UPDATE command c
SET status = 'TIMEOUT', finished_at = now(), lease_expire_at = NULL, updated_at = now()
FROM (SELECT id, status FROM command
      WHERE status IN ('PENDING', 'CLAIMED', 'SENT') AND expire_at < now()
      FOR UPDATE) AS old
WHERE c.id = old.id
RETURNING c.*, old.status AS previous_status;

-- name: cancel
-- $1 id; from PENDING, CLAIMED or SENT to CANCELLED (with the status it left: read under the
-- row lock, so a dispatcher's CLAIMED -> SENT committed while we waited is what it left).
UPDATE command c
SET status = 'CANCELLED', finished_at = now(), lease_expire_at = NULL, updated_at = now()
FROM (SELECT id, status FROM command
      WHERE id = $1 AND status IN ('PENDING', 'CLAIMED', 'SENT')
      FOR UPDATE) AS old
WHERE c.id = old.id
RETURNING c.*, old.status AS previous_status;

-- name: changed_by
-- $1 id; the command's status now and who made its latest change (its newest audit row's
-- actor; null once retention pruned them): what a cancel that lost its race answers.
SELECT c.status,
       (SELECT a.actor FROM command_audit a
        WHERE a.command_id = c.id ORDER BY a.id DESC LIMIT 1) AS actor
FROM command c WHERE c.id = $1;

-- name: cancel_open_of_device
-- $1 device; every open command of the device (unbind), with the status each one left.
UPDATE command c
SET status = 'CANCELLED', finished_at = now(), lease_expire_at = NULL, updated_at = now()
FROM (SELECT id, status FROM command
      WHERE device_id = $1 AND status IN ('PENDING', 'CLAIMED', 'SENT')
      FOR UPDATE) AS old
WHERE c.id = old.id
RETURNING c.*, old.status AS previous_status;

-- name: lock_device
-- $1 device; an unbind's first statement: the device's row locked FOR UPDATE, so it waits for
-- every creation that read the device bound (`unbound_among` holds it FOR KEY SHARE) to
-- commit, and its cancel, a statement after, sees their commands. A creation after it waits
-- for the unbind and reads the device unbound. Telemetry's FOR NO KEY UPDATE of the row is
-- never held back by a creation.
SELECT 1 FROM device WHERE device_id = $1 FOR UPDATE;

-- name: unbind_device
-- $1 device; registers an unknown device as unbound too (no commands may follow).
INSERT INTO device (device_id, first_seen, last_seen, bound)
VALUES ($1, now(), now(), false)
ON CONFLICT (device_id) DO UPDATE SET bound = false;

-- name: get_many
-- $1 ids; the commands that exist among them.
SELECT * FROM command WHERE id = ANY($1::bigint[]);

-- name: mark_sent_many
-- $1 ids, $2 generations (pairwise), $3 node, $4 seconds until timeout_at, $5 actor, $6 the
-- audit rows' note (null for PUBACKs; see mark_sent). The broker's PUBACKs of one dispatch
-- batch (or its downlinks in doubt) in one statement, each guarded like mark_sent. Rows
-- another transaction holds (a receipt being applied) are skipped, not waited for: the caller
-- writes those one by one, so this statement never waits holding other rows' locks. The ids
-- written come back (the caller needs no more of the rows).
-- The rows are found by id alone, and their status is tested on the locked row (`mine`): a
-- `status = 'CLAIMED'` on the table let PostgreSQL read every command in flight through their
-- partial index instead (it trusts its statistics to say they are few), 2-4 ms a batch with
-- 1,000 in flight, for batches of a few commands.
WITH mine AS (
    SELECT c.id, c.status
    FROM command c
    JOIN unnest($1::bigint[], $2::integer[]) AS u(id, gen) ON c.id = u.id
    WHERE c.claim_generation = u.gen AND c.claimed_node_id = $3
    ORDER BY c.id
    FOR UPDATE OF c SKIP LOCKED
), sent AS (
    UPDATE command c
    SET status = 'SENT', sent_at = now(), timeout_at = now() + make_interval(secs => $4),
        lease_expire_at = NULL, updated_at = now()
    FROM mine
    WHERE c.id = mine.id AND mine.status = 'CLAIMED'
    RETURNING c.id, c.status, c.claim_generation
), audit AS (
    INSERT INTO command_audit (command_id, actor, action, from_status, to_status,
                               claim_generation, node_id, note)
    SELECT id, $5, 'sent', 'CLAIMED', status, claim_generation, $3, $6::text FROM sent
)
SELECT id FROM sent;

-- name: apply_receipts
-- The four-guard update of apply_receipt for many receipts at once, one per command (arrays,
-- pairwise): $1 ids, $2 generations, $3 nodes, $4 expected statuses, $5 new statuses,
-- $6 results, $7 result codes, $8 raw result codes, $9 raw acks, $10 terminal, $11 retry (0/1),
-- $12 retry delays, $13 timeout seconds. The rows whose guards held come back. SENT times
-- as in apply_receipt: set by a SENT receipt on a CLAIMED command, kept on a SENT one.
-- The open statuses are tested on the expected ones (the row must still have it): on the
-- table, they matched the partial index of commands in flight, which PostgreSQL then read
-- whole rather than look the ids up (see mark_sent_many). A repeated SENT receipt is left
-- out as in apply_receipt (judged `duplicated` by the caller).
UPDATE command c
SET status = u.status, result = u.result, result_code = u.result_code,
    raw_result_code = u.raw_code, raw_ack = u.raw_ack,
    finished_at = CASE WHEN u.terminal THEN now() END,
    retry_count = c.retry_count + u.retry,
    next_attempt_at = CASE WHEN u.retry = 1 THEN now() + make_interval(secs => u.delay)
                           ELSE c.next_attempt_at END,
    lease_expire_at = NULL,
    sent_at = CASE WHEN u.expected = 'CLAIMED' AND u.status = 'SENT' THEN now()
                   ELSE c.sent_at END,
    timeout_at = CASE WHEN u.expected = 'CLAIMED' AND u.status = 'SENT'
                      THEN now() + make_interval(secs => u.timeout)
                      ELSE c.timeout_at END,
    updated_at = now()
FROM unnest($1::bigint[], $2::integer[], $3::text[], $4::text[], $5::text[], $6::text[],
            $7::integer[], $8::text[], $9::text[], $10::boolean[], $11::integer[],
            $12::double precision[], $13::double precision[])
     AS u(id, gen, node, expected, status, result, result_code, raw_code, raw_ack, terminal,
          retry, delay, timeout)
WHERE c.id = u.id AND c.claim_generation = u.gen AND c.claimed_node_id = u.node
  AND u.expected IN ('CLAIMED', 'SENT') AND c.status = u.expected
  AND NOT (u.expected = 'SENT' AND u.status = 'SENT'
           AND EXISTS (SELECT 1 FROM command_receipt r
                       WHERE r.command_id = c.id AND r.claim_generation = c.claim_generation
                         AND r.node_id = c.claimed_node_id AND r.outcome = 'accepted'))
RETURNING c.*;

-- name: insert_audits
-- Many audit rows (arrays, pairwise): $1 command ids, $2 actors, $3 actions, $4 from, $5 to,
-- $6 generations, $7 nodes.
INSERT INTO command_audit (command_id, actor, action, from_status, to_status, claim_generation,
                           node_id)
SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[],
                     $6::integer[], $7::text[]);

-- name: insert_receipts
-- Many receipt log rows (arrays, pairwise), the columns of insert_receipt in its order.
INSERT INTO command_receipt (command_id, reported_command_id, device_id, claim_generation,
                             node_id, result, result_code, raw_result_code, raw_ack, outcome,
                             reason, received_by)
SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::integer[], $5::text[],
                     $6::text[], $7::integer[], $8::text[], $9::text[], $10::text[], $11::text[],
                     $12::text[]);

-- name: unbound_among
-- $1 device ids; those registered as unbound (a device never seen takes commands). Every known
-- one is locked FOR KEY SHARE until the creation commits: an unbind (`lock_device`) waits for
-- it, then cancels what it created; one committed first is read here, after the wait.
-- A CTE, not a subquery in FROM: with the latter, only the unbound rows came out locked.
WITH known AS MATERIALIZED (
    SELECT d.device_id, d.bound
    FROM device d JOIN unnest($1::text[]) AS u(id) ON d.device_id = u.id
    ORDER BY d.device_id
    FOR KEY SHARE OF d
)
SELECT device_id FROM known WHERE NOT bound;

-- name: insert_many
-- Many new commands (arrays, pairwise): $1 devices, $2 names, $3 params json, $4 deliveries,
-- $5 idempotency keys (null for none), $6 created by; $7 expire after seconds, $8 node id.
-- Ids follow the arrays' order. A command whose device already has one with its key is not
-- inserted, nor is the second of two with the same device and key in the arrays: the first
-- one in order is. Each new command's audit row in the same statement. The new rows, by id.
WITH made AS (
    INSERT INTO command (device_id, name, params, delivery, idempotency_key, created_by,
                         expire_at)
    SELECT u.d, u.nm, u.p::jsonb, u.dl, u.k, u.cb, now() + make_interval(secs => $7)
    FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[])
         WITH ORDINALITY AS u(d, nm, p, dl, k, cb, n)
    ORDER BY u.n
    ON CONFLICT (device_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING *
), audit AS (
    INSERT INTO command_audit (command_id, actor, action, from_status, to_status,
                               claim_generation, node_id)
    SELECT id, created_by, 'create', NULL, status, claim_generation, $8 FROM made
)
SELECT * FROM made ORDER BY id;

-- name: by_idempotency_keys
-- $1 devices, $2 idempotency keys (pairwise); the commands holding those keys.
SELECT c.* FROM command c
JOIN unnest($1::text[], $2::text[]) AS u(d, k) ON c.device_id = u.d AND c.idempotency_key = u.k;
