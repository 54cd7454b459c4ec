-- name: insert
-- $1 name, $2 params json, $3 delivery, $4 target devices (or null), $5 target selector (or
-- null), $6 resolved device ids, $7 per minute (or null), $8 failure ratio (or null), $9 min
-- finished (or null), $10 idempotency key (or null), $11 created by. The rollout bucket starts
-- full: one second's worth of commands, at least one. Nothing when the key is taken.
INSERT INTO campaign (name, params, delivery, target_devices, target_selector, device_ids,
                      per_minute, rollout_tokens, rollout_at, failure_ratio, min_finished,
                      idempotency_key, created_by)
VALUES ($1, $2::jsonb, $3, $4, $5, $6, $7,
        CASE WHEN $7::integer IS NOT NULL THEN greatest(1.0, $7::integer / 60.0) END,
        CASE WHEN $7::integer IS NOT NULL THEN now() END,
        $8, $9, $10, $11)
ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING *;

-- name: by_idempotency_key
-- $1 idempotency key.
SELECT * FROM campaign WHERE idempotency_key = $1;

-- name: insert_commands
-- $1 campaign id, $2 name, $3 params json, $4 delivery, $5 created by, $6 expire after
-- seconds, $7 device ids (in order), $8 node id. One PENDING command per device, ids in the
-- list's order, paced when the campaign has a rollout limit, with each one's audit row: one
-- statement for the whole campaign. A paced command expires $6 seconds after the rollout can
-- let it out at the earliest, the n-th (n - 1) / per_minute minutes after the start: counted
-- from the creation, the tail of a rollout longer than $6 expired unsent, each a TIMEOUT the
-- abort criteria took for a device's failure.
WITH pace AS (
    SELECT k.per_minute FROM campaign k WHERE k.id = $1
), made AS (
    INSERT INTO command (device_id, name, params, delivery, created_by, expire_at, campaign_id,
                         paced)
    SELECT u.d, $2, $3::jsonb, $4, $5,
           now() + make_interval(secs => $6 + coalesce((u.n - 1) * 60.0::double precision
                                                        / p.per_minute, 0.0)),
           $1, p.per_minute IS NOT NULL
    FROM unnest($7::text[]) WITH ORDINALITY AS u(d, n) CROSS JOIN pace p
    ORDER BY u.n
    RETURNING id, status, claim_generation
), audit AS (
    INSERT INTO command_audit (command_id, actor, action, from_status, to_status,
                               claim_generation, node_id)
    SELECT id, $5, 'create', NULL, status, claim_generation, $8 FROM made
)
SELECT count(*) FROM made;

-- name: lock_targets
-- $1 device ids; the known ones with whether each is bound, sorted, locked FOR KEY SHARE until
-- the campaign commits (commands.sql `unbound_among` says why: an unbind waits for it, then
-- cancels its commands; one committed first is read here as unbound, after the wait).
SELECT d.device_id, d.bound
FROM device d JOIN unnest($1::text[]) AS u(id) ON d.device_id = u.id
ORDER BY d.device_id
FOR KEY SHARE OF d;

-- name: bound_devices
-- no parameters; every known device that takes commands, sorted (a selector picks among them).
SELECT device_id FROM device WHERE bound ORDER BY device_id;

-- name: get
-- $1 id; the campaign with its commands' count per status, in one statement (one snapshot).
SELECT k.*,
       (SELECT coalesce(jsonb_object_agg(s.status, s.n), '{}'::jsonb)
        FROM (SELECT status, count(*) AS n FROM command
              WHERE campaign_id = k.id GROUP BY status) AS s) AS counts
FROM campaign k WHERE k.id = $1;

-- name: list
-- $1 status or null, $2 before id (keyset, newest first) or null, $3 limit.
SELECT * FROM campaign
WHERE ($1::text IS NULL OR status = $1) AND ($2::bigint IS NULL OR id < $2)
ORDER BY id DESC LIMIT $3;

-- name: commands_of
-- $1 campaign id, $2 status or null, $3 before id (keyset, newest first) or null, $4 limit.
SELECT * FROM command
WHERE campaign_id = $1 AND ($2::text IS NULL OR status = $2) AND ($3::bigint IS NULL OR id < $3)
ORDER BY id DESC LIMIT $4;

-- name: running
-- no parameters; the campaigns still RUNNING, oldest first, each with whether it has abort
-- criteria and whether any of its commands is still open (PENDING, CLAIMED or SENT: three
-- probes of command_campaign_idx, however many commands it has), read without a lock.
SELECT k.id, k.failure_ratio IS NOT NULL AS may_abort,
       EXISTS (SELECT 1 FROM command c
               WHERE c.campaign_id = k.id AND c.status IN ('PENDING', 'CLAIMED', 'SENT'))
           AS has_open
FROM campaign k WHERE k.status = 'RUNNING' ORDER BY k.id;

-- name: status_of
-- $1 id; the campaign's status alone (no counts): what a cancel reads before its write.
SELECT status FROM campaign WHERE id = $1;

-- name: changed_by
-- $1 id; the campaign's status now and who made its latest change (its newest audit row's
-- actor): what a cancel that lost its race answers.
SELECT k.status,
       (SELECT a.actor FROM campaign_audit a
        WHERE a.campaign_id = k.id ORDER BY a.id DESC LIMIT 1) AS actor
FROM campaign k WHERE k.id = $1;

-- name: lock_running
-- $1 id; the campaign if it is still RUNNING, locked until the transaction ends. Statements
-- after this one see every change committed before the lock was granted.
SELECT * FROM campaign WHERE id = $1 AND status = 'RUNNING' FOR UPDATE;

-- name: counts
-- $1 campaign id; its commands' count per status.
SELECT status, count(*) AS n FROM command WHERE campaign_id = $1 GROUP BY status;

-- name: close
-- $1 id, $2 new status, $3 reason, $4 actor, $5 action, $6 node id, $7 request id or null.
-- RUNNING -> $2, once: the conditional write and its audit row in one statement.
WITH closed AS (
    UPDATE campaign
    SET status = $2, status_reason = $3, finished_at = now(), updated_at = now()
    WHERE id = $1 AND status = 'RUNNING'
    RETURNING *
), audit AS (
    INSERT INTO campaign_audit (campaign_id, actor, action, from_status, to_status, node_id,
                                note, request_id)
    SELECT id, $4, $5, 'RUNNING', status, $6, $3, $7 FROM closed
)
SELECT * FROM closed;

-- name: insert_audit
-- $1 campaign id, $2 actor, $3 action, $4 from, $5 to, $6 node, $7 note, $8 request id.
INSERT INTO campaign_audit (campaign_id, actor, action, from_status, to_status, node_id, note,
                            request_id)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8);

-- name: audit_of
-- $1 campaign id; its audit trail, oldest first.
SELECT * FROM campaign_audit WHERE campaign_id = $1 ORDER BY id;

-- name: cancel_open_commands
-- $1 campaign id, $2 actor, $3 action, $4 node id. Every open command of the campaign to
-- CANCELLED (each with the status it left, read under its row lock), with their audit rows, in
-- one statement. Rows are locked in id order.
WITH old AS (
    SELECT id, status FROM command
    WHERE campaign_id = $1 AND status IN ('PENDING', 'CLAIMED', 'SENT')
    ORDER BY id
    FOR UPDATE
), cancelled AS (
    UPDATE command c
    SET status = 'CANCELLED', finished_at = now(), lease_expire_at = NULL, updated_at = now()
    FROM old
    WHERE c.id = old.id
    RETURNING c.*, old.status AS previous_status
), audit AS (
    INSERT INTO command_audit (command_id, actor, action, from_status, to_status,
                               claim_generation, node_id)
    SELECT id, $2, $3, previous_status, status, claim_generation, $4 FROM cancelled
)
SELECT * FROM cancelled ORDER BY id;

-- name: lock_timeout
-- $1 a duration ('2000ms'); how long the statements after it in this transaction wait for a lock.
SELECT set_config('lock_timeout', $1, true);

-- name: analyze_commands
-- no parameters. A campaign is a bulk load of the command table: until its statistics see the
-- new PENDING rows, the planner takes them for a handful and plans the claim as a scan and sort
-- of every one of them (measured: 137 ms per claim of 100 with 10,000 pending, against 12 ms).
-- PostgreSQL's advice after a bulk load is ANALYZE; it samples a bounded number of rows.
ANALYZE command;
