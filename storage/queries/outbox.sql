-- name: insert_event
-- $1 event id (uuid), $2 aggregate type, $3 aggregate id, $4 event type, $5 payload json.
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
VALUES ($1, $2, $3, $4, $5::jsonb);

-- name: insert_events
-- $1 event ids (uuid), $2 aggregate type, $3 aggregate ids, $4 event type, $5 payloads json
-- (arrays, pairwise); ids are assigned in array order, which keeps each aggregate's order.
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
SELECT e, $2, a, $4, p::jsonb
FROM unnest($1::uuid[], $3::text[], $5::text[]) WITH ORDINALITY AS u(e, a, p, n)
ORDER BY n;

-- name: claim_plan
-- In the claim's own transaction, before `claim_due`: its plan must walk the open events in id
-- order and stop at the batch, then update the rows it found by their key; statistics of a
-- queue table, taken while it was quiet, make PostgreSQL sort the whole backlog first, or read
-- the whole table for the rows to update. See `claim_due`.
-- (set_config(…, true) is SET LOCAL, both in one statement.)
SELECT set_config('enable_sort', 'off', true), set_config('enable_seqscan', 'off', true);

-- name: claim_due
-- $1 node id, $2 lease seconds, $3 batch size. Claims the oldest unpublished event of each
-- aggregate (never one behind an unpublished predecessor: per-aggregate order), if it is due
-- (PENDING past next_retry_at) or its publisher's lease expired.
-- The open events are walked in id order (outbox_unpublished_idx) and each one's aggregate is
-- looked up for its oldest open event (a subquery with LIMIT, which PostgreSQL does not turn
-- into a join); the walk stops at the batch, so a claim reads rows by the batch, never by the
-- backlog. (With statistics that count no open events, PostgreSQL makes that lookup walk the
-- open events ahead of the row in id order instead of outbox_aggregate_idx: a few rows more
-- per row, those in flight or not yet due.) Written as an anti-join, it was planned from
-- statistics taken while the table held only published history as a nested loop reading the
-- whole backlog for every row it examined (a 10,000-event storm's claims of 100 beside 100,000
-- published events: 78-95 ms of PostgreSQL's CPU each, 8-10 s in all, quadratic in the
-- backlog; `scripts/hot-path claim`), or, analyzed empty, as a hash of the whole backlog at
-- every claim. `claim_plan` keeps the sort (every open event read, then sorted) and the
-- sequential scan out; a test reads the plan in each state of the statistics.
WITH due AS (
    SELECT o.id
    FROM outbox_event o
    WHERE ((o.status = 'PENDING' AND o.next_retry_at <= now())
           OR (o.status = 'PUBLISHING' AND o.lease_until < now()))
      AND o.id = (
          SELECT p.id FROM outbox_event p
          WHERE p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
            AND p.status IN ('PENDING', 'PUBLISHING')
          ORDER BY p.id LIMIT 1)
    ORDER BY o.id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_event e
SET status = 'PUBLISHING', lease_owner = $1,
    lease_until = now() + make_interval(secs => $2)
WHERE e.id = ANY (ARRAY(SELECT id FROM due))
RETURNING e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type, e.schema_version,
          e.payload::text AS payload, e.retry_count, e.in_doubt_count, e.created_at;

-- name: mark_published
-- $1 id, $2 node id; only the lease holder may, and only while it holds the lease row.
UPDATE outbox_event
SET status = 'PUBLISHED', published_at = now(), lease_until = NULL, last_error = NULL
WHERE id = $1 AND status = 'PUBLISHING' AND lease_owner = $2
RETURNING id;

-- name: mark_published_many
-- $1 ids, $2 node id; `mark_published` for each; the ids this node still held.
UPDATE outbox_event
SET status = 'PUBLISHED', published_at = now(), lease_until = NULL, last_error = NULL
WHERE id = ANY($1::bigint[]) AND status = 'PUBLISHING' AND lease_owner = $2
RETURNING id;

-- name: mark_failed
-- $1 id, $2 node id, $3 retry delay seconds, $4 error text.
UPDATE outbox_event
SET status = 'PENDING', retry_count = retry_count + 1, lease_until = NULL, lease_owner = NULL,
    next_retry_at = now() + make_interval(secs => $3), last_error = $4
WHERE id = $1 AND status = 'PUBLISHING' AND lease_owner = $2
RETURNING retry_count;

-- name: mark_dead
-- $1 id, $2 node id, $3 reason. The broker can never take the event: DEAD, never retried (it
-- no longer holds back its aggregate's later events); `dead_at` starts its retention
-- (`outbox_dead_days`). Only the lease holder may.
UPDATE outbox_event
SET status = 'DEAD', dead_at = now(), lease_until = NULL, lease_owner = NULL, last_error = $3
WHERE id = $1 AND status = 'PUBLISHING' AND lease_owner = $2
RETURNING id;

-- name: release
-- $1 ids, $2 node id, $3 error text. Publishes that failed because this node's broker session
-- was down: back to PENDING, due at once, retry_count unchanged (the backoff is for events the
-- broker refused, not for a broker that was away). The publisher claims nothing until the
-- session is back, and the session wakes it then. Only the lease holder may. Released, the
-- events are NOTIFYed on `outbox_event` (in the same statement, sent at its commit): another
-- node whose session is up takes them at once, not at its next poll.
WITH released AS (
    UPDATE outbox_event
    SET status = 'PENDING', lease_until = NULL, lease_owner = NULL, next_retry_at = now(),
        last_error = $3
    WHERE id = ANY($1::bigint[]) AND status = 'PUBLISHING' AND lease_owner = $2
    RETURNING id
), woken AS (
    SELECT pg_notify('outbox_event', '') FROM (SELECT FROM released LIMIT 1) AS any_released
)
SELECT id FROM released WHERE EXISTS (SELECT FROM woken);

-- name: release_in_doubt
-- $1 ids, $2 node id, $3 error text. As `release`, for events that were the largest publish
-- awaiting its PUBACK when the broker connection ended (the broker may have closed it for
-- them: over its packet limit, which MQTT 3.1.1 cannot say): counted in in_doubt_count; the
-- publisher gives one up (`mark_dead`) instead when that count would reach its limit.
-- NOTIFYed as `release` is.
WITH released AS (
    UPDATE outbox_event
    SET status = 'PENDING', lease_until = NULL, lease_owner = NULL, next_retry_at = now(),
        last_error = $3, in_doubt_count = in_doubt_count + 1
    WHERE id = ANY($1::bigint[]) AND status = 'PUBLISHING' AND lease_owner = $2
    RETURNING id
), woken AS (
    SELECT pg_notify('outbox_event', '') FROM (SELECT FROM released LIMIT 1) AS any_released
)
SELECT id FROM released WHERE EXISTS (SELECT FROM woken);

-- name: backlog
-- no parameters; unpublished events and the age in seconds of the oldest one.
SELECT count(*) AS backlog,
       coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_age_s
FROM outbox_event WHERE status IN ('PENDING', 'PUBLISHING');

-- name: record_consumed
-- $1 consumer, $2 event id; false when this consumer already consumed the event.
INSERT INTO consumed_event (consumer, event_id) VALUES ($1, $2)
ON CONFLICT DO NOTHING
RETURNING true;
