-- The alarm desk (docs/behaviour.md §5): the list's filters, counts and groups, shelves and
-- out-of-service periods. Shelved and out of service mean what the functions of migration 0030
-- say (alarm_shelved_until, device_out_of_service_at); `one` and `chain` call them, while
-- `list`, `groups` and `counts`, which read thousands of alarms, write them out: a call of
-- either costs ~70 µs an alarm (PostgreSQL does not inline a SQL function with a sub-SELECT),
-- seconds over a long history (scripts/desk-scale, docs/performance.md). Shelved now: two
-- joins on the shelves in force now (sa by alarm, sp by pair: one pass over alarm_shelf
-- each), the later end of the two (greatest ignores a null); `shown_in` is the shelved filter
-- ($8) that shows the alarm, compared with <> to the other one so that the planner expects
-- most alarms to pass (a test of `until IS NULL` it would guess passes 0.5% of them, and
-- sort the whole open list rather than read it by id). Out of service: an EXISTS per alarm
-- the list shows (after its LIMIT), and in counts only for the alarms of devices that ever
-- had a period. The list and groups are planned per call (storage/desk.py).
--
-- The filters, in this order in every block that takes them: $1 statuses or null, $2 device or
-- null, $3 rule or null, $4 open only, $5 active (not cleared) or null, $6 cleared or null,
-- $7 acknowledged or null, $8 shelved: 'exclude' (the default view), 'only' or 'any',
-- $9 severity or null. "Acknowledged": a person took a step (confirmed, handled or judged
-- false: confirmed_at, handled_at or false_at is set).

-- name: list
-- The filters ($1-$9), $10 before id (keyset, newest first) or null, $11 limit; a read as
-- `groups` answered it, or nulls: $12 its snapshot's xmin, $13 its xmax, $14 the transactions
-- running then (bigint[]), $15 its time: only the alarms whose creation it saw (as
-- pg_visible_in_snapshot tells, written out: any numbers a client sends compare, none is an
-- error), that had a status of $1 in it as well as now (the status before the first change
-- of status it did not see, by the audit rows: each change writes one in its transaction,
-- holding the alarm's row, so their ids are in commit order; a DELAYED alarm woken to NEW
-- after a status=NEW read was not in the group anybody saw), and that the shelved filter
-- ($8) took then as well as now
-- (a bulk action over a group as it was read: an alarm it left out as shelved, whose shelf
-- was lifted since, was not in the group anybody saw); each alarm with until when it is
-- shelved now (null: not shelved) and whether its device was out of service when raised.
SELECT a.*, sh.until AS shelved_until,
       EXISTS (
           SELECT 1 FROM device_out_of_service o
           WHERE o.device_id = a.device_id AND o.since <= a.triggered_at
             AND a.triggered_at < least(coalesce(o.until, 'infinity'::timestamptz),
                                        coalesce(o.ended_at, 'infinity'::timestamptz)))
           AS out_of_service
FROM alarm a
LEFT JOIN alarm_shelf_by_alarm sa ON sa.alarm_id = a.id
LEFT JOIN alarm_shelf_by_pair sp ON sp.device_id = a.device_id AND sp.rule_key = a.rule_key
CROSS JOIN LATERAL (
    SELECT greatest(sa.ends, sp.ends) AS until,
           CASE WHEN greatest(sa.ends, sp.ends) IS NULL THEN 'exclude' ELSE 'only' END AS shown_in
) sh
WHERE ($1::text[] IS NULL OR a.status = ANY ($1::text[]))
  AND ($2::text IS NULL OR a.device_id = $2)
  AND ($3::text IS NULL OR a.rule_key = $3)
  AND (NOT $4::boolean OR a.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED'))
  AND ($5::boolean IS NULL OR (a.cleared_at IS NULL) = $5)
  AND ($6::boolean IS NULL OR (a.cleared_at IS NOT NULL) = $6)
  AND ($7::boolean IS NULL
       OR (a.confirmed_at IS NOT NULL OR a.handled_at IS NOT NULL OR a.false_at IS NOT NULL) = $7)
  AND ($8::text = 'any'
       OR sh.shown_in <> CASE $8::text WHEN 'only' THEN 'exclude' ELSE 'only' END)
  AND ($9::text IS NULL OR a.severity = $9)
  AND ($10::bigint IS NULL OR a.id < $10)
  AND ($12::bigint IS NULL OR a.created_xid IS NULL
       OR a.created_xid::text::bigint < $12::bigint
       OR (a.created_xid::text::bigint < $13::bigint
           AND a.created_xid::text::bigint <> ALL ($14::bigint[])))
  AND ($1::text[] IS NULL OR $12::bigint IS NULL
       OR coalesce(
              (SELECT coalesce(au.from_status, '') FROM alarm_audit au  -- '': not yet raised
               CROSS JOIN LATERAL (  -- the row's xid, as the xid8 nearest the read's xmax
                   SELECT $13::bigint + ((au.xmin::text::bigint - ($13::bigint & 4294967295)
                                          + 2147483648) & 4294967295) - 2147483648 AS x
               ) w
               WHERE au.alarm_id = a.id AND au.from_status IS DISTINCT FROM au.to_status
                 AND NOT (w.x < $12::bigint
                          OR (w.x < $13::bigint AND w.x <> ALL ($14::bigint[])))
               ORDER BY au.id LIMIT 1),
              a.status) = ANY ($1::text[]))
  AND ($15::timestamptz IS NULL OR $8::text = 'any'
       OR EXISTS (  -- alarm_shelved_until(a.id, a.device_id, a.rule_key, $15) IS NOT NULL
              SELECT 1 FROM alarm_shelf s
              WHERE ((s.scope = 'alarm' AND s.alarm_id = a.id)
                     OR (s.scope = 'pair' AND s.device_id = a.device_id
                         AND s.rule_key = a.rule_key))
                AND s.shelved_at <= $15
                AND $15 < least(s.until, coalesce(s.ended_at, 'infinity'::timestamptz)))
          = ($8::text = 'only'))
ORDER BY a.id DESC
LIMIT $11;

-- name: plan_per_call
-- no parameters; the session's plan_cache_mode, and force_custom_plan for the rest of the
-- caller's transaction: the desk's reads planned for their own arguments, not one generic
-- plan for any filter (storage.desk._fetch_planned_per_call).
SELECT current_setting('plan_cache_mode'), set_config('plan_cache_mode', 'force_custom_plan', true);

-- name: plan_cache_mode_back
-- $1 the plan_cache_mode plan_per_call read: set again for the rest of the caller's transaction.
SELECT set_config('plan_cache_mode', $1, true);

-- name: one
-- $1 id; the alarm as `list` gives it.
SELECT a.*, alarm_shelved_until(a.id, a.device_id, a.rule_key, now()) AS shelved_until,
       device_out_of_service_at(a.device_id, a.triggered_at) AS out_of_service
FROM alarm a WHERE a.id = $1;

-- name: chain
-- $1 id; the alarm and every alarm that reaches it backwards through superseded_by (a
-- superseded alarm: itself alone), oldest first, each as `list` gives it: one statement
-- whatever the chain's length (each firing on a device nobody attends supersedes the alarm
-- before it: thousands a day), in one snapshot.
WITH RECURSIVE chain AS (
    SELECT a.id, a.status = 'SUPERSEDED' AS alone FROM alarm a WHERE a.id = $1
    UNION ALL
    SELECT p.id, false FROM alarm p JOIN chain c ON p.superseded_by = c.id WHERE NOT c.alone
)
SELECT a.*, alarm_shelved_until(a.id, a.device_id, a.rule_key, now()) AS shelved_until,
       device_out_of_service_at(a.device_id, a.triggered_at) AS out_of_service
FROM chain JOIN alarm a ON a.id = chain.id
ORDER BY a.id;

-- name: groups
-- The filters ($1-$9), $10 'rule' or 'device', $11 limit, $12 and $13 the keyset cursor (the
-- worst severity and newest id of the last group of the page before) or nulls; one row per
-- rule (or device): how many alarms, the newest one's trigger time and id, the worst severity
-- (1 INFO .. 4 CRITICAL), worst first, then newest first (an alarm is in one group: no two
-- groups share a newest id, so the order is total); and the read they were read in (`as_of`:
-- the statement's snapshot, `@`, its time in microseconds since 1970: ids commit out of order,
-- so an alarm below newest_id may be one it did not see, and one it left out as shelved may be
-- unshelved since).
SELECT * FROM (
SELECT CASE WHEN $10::text = 'rule' THEN a.rule_key ELSE a.device_id END AS key,
       pg_current_snapshot()::text || '@' || (extract(epoch FROM now()) * 1000000)::bigint
           AS as_of,
       count(*) AS count,
       max(a.triggered_at) AS newest_at,
       max(a.id) AS newest_id,
       max(CASE a.severity WHEN 'INFO' THEN 1 WHEN 'WARNING' THEN 2 WHEN 'MAJOR' THEN 3
                           ELSE 4 END) AS worst
FROM alarm a
LEFT JOIN alarm_shelf_by_alarm sa ON sa.alarm_id = a.id
LEFT JOIN alarm_shelf_by_pair sp ON sp.device_id = a.device_id AND sp.rule_key = a.rule_key
CROSS JOIN LATERAL (
    SELECT greatest(sa.ends, sp.ends) AS until,
           CASE WHEN greatest(sa.ends, sp.ends) IS NULL THEN 'exclude' ELSE 'only' END AS shown_in
) sh
WHERE ($1::text[] IS NULL OR a.status = ANY ($1::text[]))
  AND ($2::text IS NULL OR a.device_id = $2)
  AND ($3::text IS NULL OR a.rule_key = $3)
  AND (NOT $4::boolean OR a.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED'))
  AND ($5::boolean IS NULL OR (a.cleared_at IS NULL) = $5)
  AND ($6::boolean IS NULL OR (a.cleared_at IS NOT NULL) = $6)
  AND ($7::boolean IS NULL
       OR (a.confirmed_at IS NOT NULL OR a.handled_at IS NOT NULL OR a.false_at IS NOT NULL) = $7)
  AND ($8::text = 'any'
       OR sh.shown_in <> CASE $8::text WHEN 'only' THEN 'exclude' ELSE 'only' END)
  AND ($9::text IS NULL OR a.severity = $9)
GROUP BY 1
) g
WHERE $12::integer IS NULL OR (g.worst, g.newest_id) < ($12::integer, $13::bigint)
ORDER BY g.worst DESC, g.newest_id DESC
LIMIT $11;

-- name: counts
-- no parameters; open alarms per severity, in exclusive buckets: shelved ones apart, the rest
-- by active (not cleared) or returned to normal, and acknowledged or not; and, overlapping
-- those, how many were raised while their device was out of service. One pass over the open
-- alarms (a partial index of them), joined to the shelves in force (see the top).
SELECT a.severity,
       count(*) AS total,
       count(*) FILTER (WHERE sh.until IS NULL AND a.cleared_at IS NULL AND NOT ack.yes)
           AS active_unacknowledged,
       count(*) FILTER (WHERE sh.until IS NULL AND a.cleared_at IS NULL AND ack.yes)
           AS active_acknowledged,
       count(*) FILTER (WHERE sh.until IS NULL AND a.cleared_at IS NOT NULL AND NOT ack.yes)
           AS returned_unacknowledged,
       count(*) FILTER (WHERE sh.until IS NULL AND a.cleared_at IS NOT NULL AND ack.yes)
           AS returned_acknowledged,
       count(*) FILTER (WHERE sh.until IS NOT NULL) AS shelved,
       count(*) FILTER (
           WHERE a.device_id IN (SELECT o.device_id FROM device_out_of_service o)
             AND EXISTS (
                 SELECT 1 FROM device_out_of_service o
                 WHERE o.device_id = a.device_id AND o.since <= a.triggered_at
                   AND a.triggered_at < least(coalesce(o.until, 'infinity'::timestamptz),
                                              coalesce(o.ended_at, 'infinity'::timestamptz))))
           AS out_of_service
FROM alarm a
LEFT JOIN alarm_shelf_by_alarm sa ON sa.alarm_id = a.id
LEFT JOIN alarm_shelf_by_pair sp ON sp.device_id = a.device_id AND sp.rule_key = a.rule_key
CROSS JOIN LATERAL (
    SELECT greatest(sa.ends, sp.ends) AS until,
           CASE WHEN greatest(sa.ends, sp.ends) IS NULL THEN 'exclude' ELSE 'only' END AS shown_in
) sh
CROSS JOIN LATERAL (
    SELECT (a.confirmed_at IS NOT NULL OR a.handled_at IS NOT NULL OR a.false_at IS NOT NULL)
           AS yes
) ack
WHERE a.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED')
GROUP BY a.severity;

-- name: shelf_target
-- $1 alarm id; what a shelf of it (or of its pair) needs: its device, rule and status.
SELECT id, device_id, rule_key, status FROM alarm WHERE id = $1;

-- name: insert_shelf
-- $1 scope ('alarm' or 'pair'), $2 alarm id or null, $3 device, $4 rule key, $5 reason,
-- $6 by, $7 seconds, $8 node id, $9 request id or null; nothing when a shelf not ended already
-- covers the same alarm (or pair).
INSERT INTO alarm_shelf (scope, alarm_id, device_id, rule_key, reason, shelved_by, until,
                         node_id, request_id)
VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7), $8, $9)
ON CONFLICT DO NOTHING
RETURNING *;

-- name: open_shelf
-- $1 scope, $2 alarm id or null, $3 device, $4 rule key; the shelf of that alarm (or pair) not
-- ended yet, if any (it may be past its until: the timer has not ended it yet).
SELECT * FROM alarm_shelf
WHERE ended_at IS NULL AND scope = $1
  AND (($1 = 'alarm' AND alarm_id = $2) OR ($1 = 'pair' AND device_id = $3 AND rule_key = $4));

-- name: get_shelf
-- $1 id.
SELECT * FROM alarm_shelf WHERE id = $1;

-- name: list_shelves
-- $1 in force only, $2 before id (keyset, newest first) or null, $3 limit.
SELECT * FROM alarm_shelf
WHERE (NOT $1::boolean OR (ended_at IS NULL AND until > now()))
  AND ($2::bigint IS NULL OR id < $2)
ORDER BY id DESC
LIMIT $3;

-- name: lift_shelf
-- $1 id, $2 who; ends a shelf in force now (one not ended and not past its until).
UPDATE alarm_shelf SET ended_at = now(), ended_by = $2, end_reason = 'lifted'
WHERE id = $1 AND ended_at IS NULL AND until > now()
RETURNING *;

-- name: expire_shelf
-- $1 id, $2 who; ends a shelf past its until, at its until (a conditional write: once).
UPDATE alarm_shelf SET ended_at = until, ended_by = $2, end_reason = 'expired'
WHERE id = $1 AND ended_at IS NULL AND until <= now()
RETURNING *;

-- name: expire_due
-- $1 now, $2 who, $3 limit; shelves past their until, ended at it. Another node's pass skips
-- the rows this one holds, then finds them ended: each shelf ends once.
-- The rows due are found once, then looked up by id (see alarms.sql, mark_unreached).
WITH due AS (
    SELECT id FROM alarm_shelf
    WHERE ended_at IS NULL AND until <= $1
    ORDER BY until, id LIMIT $3
    FOR UPDATE SKIP LOCKED
)
UPDATE alarm_shelf s SET ended_at = s.until, ended_by = $2, end_reason = 'expired'
WHERE s.id = ANY (ARRAY(SELECT id FROM due)) AND s.ended_at IS NULL
RETURNING s.*;

-- name: audit_shelf_step
-- $1 scope, $2 alarm id or null, $3 device, $4 rule key, $5 actor, $6 action, $7 note,
-- $8 request id or null, $9 node id; an audit row on each alarm a shelf step concerns: the
-- alarm, or the pair's open alarms (status unchanged: from = to). The ids audited.
INSERT INTO alarm_audit (alarm_id, actor, action, from_status, to_status, note, request_id,
                         node_id)
SELECT a.id, $5, $6, a.status, a.status, $7, $8, $9
FROM alarm a
WHERE ($1 = 'alarm' AND a.id = $2)
   OR ($1 = 'pair' AND a.device_id = $3 AND a.rule_key = $4
       AND a.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED'))
RETURNING alarm_id;

-- name: device_known
-- $1 device id.
SELECT EXISTS (SELECT 1 FROM device WHERE device_id = $1);

-- name: end_open_period
-- $1 device id, $2 who; ends the device's period not ended yet, if any: now, or at its until
-- when that passed already. The row ended.
UPDATE device_out_of_service
SET ended_at = greatest(since, least(now(), coalesce(until, now()))), ended_by = $2
WHERE device_id = $1 AND ended_at IS NULL
RETURNING *;

-- name: until_ahead
-- $1 until or null; whether a period until then would be in force now (null: until ended).
SELECT $1::timestamptz IS NULL OR $1::timestamptz > now();

-- name: insert_period
-- $1 device id, $2 reason, $3 by, $4 until or null, $5 request id or null; nothing when
-- $4 is not in the future, or when another request's period not ended is in the way (it
-- committed after `end_open_period` looked: the caller ends it and tries again).
INSERT INTO device_out_of_service (device_id, reason, set_by, until, request_id)
SELECT $1, $2, $3, $4, $5
WHERE $4::timestamptz IS NULL OR $4::timestamptz > now()
ON CONFLICT DO NOTHING
RETURNING *;

-- name: end_period_in_force
-- $1 device id, $2 who; ends the period in force now (DELETE): none when there is none. Now,
-- or at its start when another request put it in force after this transaction began (the
-- database's now() is its start): a period never ends before it began.
UPDATE device_out_of_service SET ended_at = greatest(since, now()), ended_by = $2
WHERE device_id = $1 AND ended_at IS NULL AND (until IS NULL OR until > now())
RETURNING *;

-- name: period_in_force
-- $1 device id; the device's out-of-service period in force now, if any.
SELECT * FROM device_out_of_service
WHERE device_id = $1 AND ended_at IS NULL AND (until IS NULL OR until > now());
