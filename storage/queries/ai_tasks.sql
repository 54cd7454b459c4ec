-- name: insert_task
-- $1 alarm id, $2 attempt, $3 model name, $4 prompt version, $5 delay seconds before it is due.
INSERT INTO ai_task (alarm_id, attempt, model_name, prompt_version, next_attempt_at)
VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5))
ON CONFLICT (alarm_id, attempt) DO NOTHING
RETURNING id;

-- name: insert_first_tasks
-- $1 alarm ids, $2 model name, $3 prompt version; attempt 1 of each, due now.
INSERT INTO ai_task (alarm_id, attempt, model_name, prompt_version, next_attempt_at)
SELECT a, 1, $2, $3, now() FROM unnest($1::bigint[]) AS u(a)
ON CONFLICT (alarm_id, attempt) DO NOTHING;

-- name: lock_due
-- $1 the prompt versions this node has; one due PENDING task of one of them, locked (another
-- worker skips it). A task of a version this release lacks (written by a newer node during a
-- rolling upgrade) is left to the nodes that have it.
SELECT id, alarm_id, attempt, model_name, prompt_version
FROM ai_task
WHERE status = 'PENDING' AND next_attempt_at <= now() AND prompt_version = ANY($1::text[])
ORDER BY next_attempt_at, id
LIMIT 1
FOR UPDATE SKIP LOCKED;

-- name: start
-- $1 id, $2 claim token, $3 worker (node id), $4 request payload json, $5 the model the worker
-- asks (its own server's, whatever the node that created the task was configured with);
-- PENDING → PROCESSING.
UPDATE ai_task
SET status = 'PROCESSING', claim_token = $2, claimed_by = $3, started_at = now(),
    request_payload = $4::jsonb, model_name = $5
WHERE id = $1 AND status = 'PENDING'
RETURNING id, started_at;

-- name: alarm_reason
-- $1 alarm id, $2 the type of its creation event; the reason the rule gave when it raised the
-- alarm, kept with it (migration 0058), and, for an alarm created before that (reason null),
-- its creation event's payload, which holds it while retention keeps the event (outbox_days).
SELECT a.reason,
       CASE WHEN a.reason IS NULL THEN (
           SELECT e.payload::text FROM outbox_event e
           WHERE e.aggregate_type = 'alarm' AND e.aggregate_id = $1::bigint::text
             AND e.event_type = $2
           ORDER BY e.id LIMIT 1)
       END AS created
FROM alarm a WHERE a.id = $1::bigint;

-- name: recent_telemetry
-- $1 device, $2 the alarm's triggered_at, $3 limit; the samples stored by then (the trigger's
-- own batch included: its received_at is that batch's now(), as triggered_at), newest device
-- time first. Not "dated up to triggered_at": a device clock ahead of the database's dates its
-- trigger after it, and the prompt lost the very sample that raised the alarm.
SELECT ts, metrics::text AS metrics, events::text AS events
FROM telemetry WHERE device_id = $1 AND received_at <= $2
ORDER BY ts DESC LIMIT $3;

-- name: succeed
-- $1 id, $2 claim token, then the validated summary: $3 summary, $4 possible cause,
-- $5 inspection suggestion, $6 risk level, $7 confidence, $8 raw response, $9 model name.
-- Written only if the task is still this claim's (a reset task keeps its reset).
UPDATE ai_task
SET status = 'SUCCEEDED', summary = $3, possible_cause = $4, inspection_suggestion = $5,
    risk_level = $6, confidence = $7, raw_response = $8, model_name = $9, finished_at = now()
WHERE id = $1 AND status = 'PROCESSING' AND claim_token = $2
RETURNING *;

-- name: fail
-- $1 id, $2 claim token, $3 error code, $4 error message, $5 raw response or null.
UPDATE ai_task
SET status = 'FAILED', error_code = $3, error_message = $4, raw_response = $5,
    finished_at = now()
WHERE id = $1 AND status = 'PROCESSING' AND claim_token = $2
RETURNING *;

-- name: finished_by_claim
-- $1 id, $2 claim token; the task as this claim's result left it (a write whose COMMIT went
-- through unheard), else nothing. A sweep keeps the token but says WORKER_LOST: not the claim's.
SELECT * FROM ai_task
WHERE id = $1 AND claim_token = $2
  AND (status = 'SUCCEEDED' OR (status = 'FAILED' AND error_code <> 'WORKER_LOST'));

-- name: sweep_lost
-- $1 processing timeout seconds; tasks whose worker died mid-call: FAILED WORKER_LOST.
UPDATE ai_task
SET status = 'FAILED', error_code = 'WORKER_LOST',
    error_message = 'no result within ' || $1::text || ' s of the claim by ' || claimed_by,
    finished_at = now()
WHERE status = 'PROCESSING' AND started_at < now() - make_interval(secs => $1)
RETURNING *;

-- name: reset
-- $1 id; an operator's (or a test's) reset of a task in flight: back to PENDING.
UPDATE ai_task
SET status = 'PENDING', claim_token = NULL, claimed_by = NULL, started_at = NULL,
    request_payload = NULL, next_attempt_at = now()
WHERE id = $1 AND status = 'PROCESSING'
RETURNING id;

-- name: release
-- $1 id, $2 claim token; a stopping node gives back the task it claimed, if still its claim:
-- PENDING again, the same attempt, due now (another node, or this one's next start, takes it).
UPDATE ai_task
SET status = 'PENDING', claim_token = NULL, claimed_by = NULL, started_at = NULL,
    request_payload = NULL, next_attempt_at = now()
WHERE id = $1 AND status = 'PROCESSING' AND claim_token = $2
RETURNING id;

-- name: latest_for_alarm
-- $1 alarm id; its newest attempt.
SELECT * FROM ai_task WHERE alarm_id = $1 ORDER BY attempt DESC LIMIT 1;

-- name: for_alarm
-- $1 alarm id; every attempt, oldest first.
SELECT * FROM ai_task WHERE alarm_id = $1 ORDER BY attempt;
