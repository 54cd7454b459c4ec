-- name: now
-- no parameters; the transaction's time on the database clock, the one every node shares: the
-- time a consumer's pass or a group's repeat judges quiet hours and due repeats at.
SELECT now();

-- name: ensure_consumer
-- $1 consumer; its progress row. The gateway's own (`notify`) is created by migration 0011
-- past every older event; any other starts at horizon 0.
INSERT INTO notify_consumer (consumer) VALUES ($1) ON CONFLICT DO NOTHING;

-- name: read_horizon
-- $1 consumer; its horizon, and the oldest transaction still running now (as text: xid8).
-- Every transaction older than `running` has finished, so all it wrote is visible to any
-- statement that starts after this one.
SELECT horizon::text AS horizon,
       pg_snapshot_xmin(pg_current_snapshot())::text AS running
FROM notify_consumer WHERE consumer = $1;

-- name: skip_horizon
-- $1 consumer; with no event type to read: the horizon moves to the oldest transaction still
-- running (every older one has ended), never backwards.
UPDATE notify_consumer
SET horizon = greatest(horizon, pg_snapshot_xmin(pg_current_snapshot())), updated_at = now()
WHERE consumer = $1;

-- name: scan_unconsumed
-- $1 consumer, $2 horizon (xid8 as text), $3 batch size, $4 the event types it reads. Events
-- of those types written by transactions at or after the horizon that this consumer has not
-- consumed yet, oldest first.
SELECT o.id, o.event_id, o.aggregate_type, o.aggregate_id, o.event_type,
       o.payload::text AS payload, o.created_at
FROM outbox_event o
WHERE o.xid >= $2::text::xid8
  AND o.event_type = ANY($4::text[])
  AND NOT EXISTS (
      SELECT 1 FROM consumed_event c WHERE c.consumer = $1 AND c.event_id = o.event_id)
ORDER BY o.id
LIMIT $3;

-- name: consume_events
-- $1 consumer, $2 event ids (uuid[]); the ids consumed now (not before, by anyone): in the
-- caller's transaction, which creates their deliveries. A racing node's insert of the same
-- id waits for this transaction and then finds the conflict.
INSERT INTO consumed_event (consumer, event_id)
SELECT $1, e FROM unnest($2::uuid[]) WITH ORDINALITY AS u(e, n) ORDER BY n
ON CONFLICT DO NOTHING
RETURNING event_id;

-- name: advance_horizon
-- $1 consumer, $2 `running` read before the scan, $3 the event types it reads. The new
-- horizon: `running`, or the oldest transaction below it with an event of those types still
-- unconsumed; never backwards.
UPDATE notify_consumer n
SET horizon = greatest(n.horizon, least($2::text::xid8, coalesce((
        SELECT min(o.xid) FROM outbox_event o
        WHERE o.xid >= n.horizon AND o.xid < $2::text::xid8
          AND o.event_type = ANY($3::text[])
          AND NOT EXISTS (
              SELECT 1 FROM consumed_event c WHERE c.consumer = $1 AND c.event_id = o.event_id)
    ), $2::text::xid8))),
    updated_at = now()
WHERE n.consumer = $1
RETURNING n.horizon::text AS horizon;

-- name: lock_held_alarms
-- $1 alarm ids; of those, the ones quiet hours hold (DELAYED), locked (share, in id order)
-- until the consumer's transaction ends, before their facts are read: their wake (or a
-- person's step out of DELAYED) waits for the deliveries made from what is read, and then
-- finds them (the wake releases them, the step suppresses them); one under way is waited
-- for, and the alarm read as it left it. Without it, a wake committed between the consumer's
-- read and its insert released nothing, and the notification, read DELAYED, stayed due when
-- the consumer's quiet hours would end (or in a day) while its alarm was NEW.
SELECT id FROM alarm WHERE id = ANY($1::bigint[]) AND status = 'DELAYED'
ORDER BY id
FOR SHARE;

-- name: alarm_facts
-- $1 alarm ids; what a notification says of each alarm as it is now; and, named apart (not
-- among the times a notification shows), when quiet hours last delayed it and woke it, and
-- when and by which alarm it was superseded: whether people took it while it was held.
SELECT id, device_id, rule_key, severity, status, triggered_at, pushed_at, confirmed_at,
       confirmed_by, escalated_at, handled_at, handled_by, closed_at, closed_by, cleared_at,
       delayed_at AS quiet_delayed, woken_at AS quiet_woken, superseded_at AS quiet_superseded,
       superseded_by
FROM alarm WHERE id = ANY($1::bigint[]);

-- name: alarm_suppressions
-- $1 alarm ids, $2 event times (arrays, pairwise); for each pair whose alarm was shelved at
-- that time (the shelf covering it), or raised while its device was out of service: why its
-- notifications are suppressed (docs/behaviour.md §5, Shelving, Out of service).
SELECT u.n::int AS n,
       (SELECT s.id FROM alarm_shelf s
        WHERE ((s.scope = 'alarm' AND s.alarm_id = a.id)
               OR (s.scope = 'pair' AND s.device_id = a.device_id AND s.rule_key = a.rule_key))
          AND s.shelved_at <= u.at
          AND u.at < least(s.until, coalesce(s.ended_at, 'infinity'::timestamptz))
        ORDER BY s.id LIMIT 1) AS shelf_id,
       device_out_of_service_at(a.device_id, a.triggered_at) AS out_of_service
FROM unnest($1::bigint[], $2::timestamptz[]) WITH ORDINALITY AS u(alarm_id, at, n)
JOIN alarm a ON a.id = u.alarm_id;

-- name: lock_ended_shelves
-- $1 shelf ids (sorted); the consumer suppressing notifications for these shelves holds them
-- (share) until it commits, so a shelf's end (an update of its row: lift, expiry) either
-- waits for those notifications (and its shelf_returns, a later statement, sees them) or
-- ended first: then the lock waits for it, and the rows returned here, those ended, are the
-- ends the caller must settle itself (a notification written under the shelf but read after
-- its end: a consumer behind). Row locks taken in id order; an expiry skips a row held so.
SELECT id, scope, alarm_id, device_id, rule_key, ended_at, ended_by, end_reason
FROM alarm_shelf WHERE id = ANY($1::bigint[])
ORDER BY id
FOR SHARE;

-- name: hold_shelf_ends
-- $1 device ids, $2 rule keys (pairwise): the pairs of the shelves whose end this transaction
-- settles (a lift, an expiry pass, a consumer settling ends it found). Every shelf over an
-- alarm is over its pair (its own shelf, or the pair's), so the ends that may concern one
-- alarm are made one after the other across nodes: without it, two shelves over one alarm
-- ending at once each saw the other still in force (uncommitted: nobody told) or each saw it
-- past its until (both told: twice). Transaction-level advisory locks (class 45, the key a
-- hash of the pair: a collision only serialises two pairs), taken in key order, all before
-- the ends' groups and audit rows, so two passes never wait on each other in a circle.
SELECT pg_advisory_xact_lock(45, h)
FROM (SELECT DISTINCT hashtext(d || chr(31) || k) AS h
      FROM unnest($1::text[], $2::text[]) AS u(d, k)) x
ORDER BY h;

-- name: active_silences
-- no parameters; silences in force now.
SELECT id, matchers::text AS matchers, starts_at, ends_at
FROM notify_silence WHERE starts_at <= now() AND ends_at > now()
ORDER BY id;

-- name: insert_deliveries
-- $1 event ids, $2 outbox ids, $3 events, $4 receivers, $5 bodies (json text), $6 alarm ids,
-- $7 device ids, $8 rule keys, $9 severities, $10 silence ids (null: not silenced),
-- $11 due in seconds, $12 event creation times, $13 inhibiting alarm ids (null: not
-- inhibited), $14 inhibition rule names, $15 why suppressed (null: not; a shelf, out of
-- service), $16 whether the route that chose the receiver groups (a shelf's end tells only
-- the ungrouped ones again: shelf_returns) (arrays, pairwise). Silenced, suppressed and
-- inhibited ones are final; a silence decides first, then a suppression, then an inhibition.
INSERT INTO notify_delivery (
    event_id, outbox_id, event, receiver, body, alarm_id, device_id, rule_key, severity,
    status, silence_id, suppressed, next_attempt_at, event_created_at, finished_at,
    inhibited_by, inhibit_rule, route_grouped)
SELECT e, o, ev, r, b::jsonb, a, d, k, s,
       CASE WHEN si IS NOT NULL THEN 'SILENCED' WHEN sup IS NOT NULL THEN 'SUPPRESSED'
            WHEN ib IS NOT NULL THEN 'INHIBITED' ELSE 'PENDING' END,
       si, CASE WHEN si IS NULL THEN sup END,
       now() + make_interval(secs => due), created,
       CASE WHEN si IS NULL AND sup IS NULL AND ib IS NULL THEN NULL ELSE now() END,
       CASE WHEN si IS NULL AND sup IS NULL THEN ib END,
       CASE WHEN si IS NULL AND sup IS NULL THEN ir END, grouped
FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[], $5::text[], $6::bigint[],
            $7::text[], $8::text[], $9::text[], $10::bigint[], $11::float8[],
            $12::timestamptz[], $13::bigint[], $14::text[], $15::text[], $16::boolean[])
     AS u(e, o, ev, r, b, a, d, k, s, si, due, created, ib, ir, sup, grouped)
ON CONFLICT (event_id, receiver) DO NOTHING
RETURNING id, receiver, status;

-- name: open_alarms_of_rules
-- $1 rule keys; the open alarms of those rules (not cleared, not dealt with): the possible
-- inhibition sources.
SELECT id, device_id, rule_key, severity FROM alarm
WHERE rule_key = ANY($1::text[]) AND cleared_at IS NULL
  AND status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED')
ORDER BY id;

-- name: lock_group
-- $1 receiver, $2 group key, $3 labels (json); the group's row, made if new, locked until
-- the caller's transaction ends: one consumer at a time adds to a group's windows.
INSERT INTO notify_group (receiver, group_key, labels) VALUES ($1, $2, $3::jsonb)
ON CONFLICT (receiver, group_key) DO UPDATE SET labels = EXCLUDED.labels
RETURNING id, windows, window_delivery_id, window_due_at;

-- name: open_window
-- $1 delivery id; the group's latest window if it is still open: its delivery not claimed
-- yet, and no repeat (which lists what was sent before) (locked: a claim waits, or skips it,
-- until the caller commits); with the number of notifications it lists (a window that has
-- its route's group_max_notifications takes no more: the next one opens beside it).
SELECT id, (body ->> 'count')::int AS count FROM notify_delivery
WHERE id = $1 AND status = 'PENDING' AND attempts = 0
  AND NOT coalesce((body ->> 'repeat')::boolean, false)
FOR UPDATE;

-- name: append_to_window
-- $1 delivery id, $2 notification (json); the window's body lists it too.
UPDATE notify_delivery
SET body = jsonb_set(jsonb_set(body, '{notifications}',
                               (body -> 'notifications') || jsonb_build_array($2::jsonb)),
                     '{count}', to_jsonb((body ->> 'count')::int + 1))
WHERE id = $1;

-- name: insert_window
-- $1 event id (the window's), $2 outbox id (its first event's), $3 receiver, $4 body (json),
-- $5 due at, $6 first event's creation time, $7 group id, $8 device, $9 rule, $10 severity
-- (the group's labels, where it groups by them).
INSERT INTO notify_delivery (
    event_id, outbox_id, event, receiver, body, device_id, rule_key, severity,
    next_attempt_at, event_created_at, group_id)
VALUES ($1, $2, 'notify.group', $3, $4::jsonb, $8, $9, $10, greatest($5, now()), $6, $7)
ON CONFLICT (event_id, receiver) DO NOTHING
RETURNING id;

-- name: set_window
-- $1 group id, $2 window count, $3 window delivery id, $4 due at, $5 repeat interval s,
-- $6 group interval s, $7 a repeat (which pays what a shelf's end owed the group), $8 the
-- identity of the route that made the window (null or empty: a repeat, which keeps the
-- group's). A new window starts a stopped group's repeats again.
UPDATE notify_group
SET windows = $2, window_delivery_id = $3, window_due_at = $4, repeat_interval_s = $5,
    group_interval_s = $6, repeat_stopped = false,
    route_identity = coalesce(nullif($8::text, ''), route_identity),
    resume_at = CASE WHEN $7 THEN NULL ELSE resume_at END,
    resume_alarm_ids = CASE WHEN $7 THEN NULL ELSE resume_alarm_ids END
WHERE id = $1;

-- name: add_member
-- $1 delivery id, $2 event id, $3 alarm id (or null), $4 the window's group id, $5 the
-- notification (json; null: the group has it already, a repeat, or its route never repeats).
-- One with an alarm is the group's too (notify_group_member, what its repeats list while the
-- alarm is open).
WITH grouped AS (
    INSERT INTO notify_group_member (group_id, event_id, alarm_id, body)
    SELECT $4, $2, $3, $5::jsonb WHERE $3::bigint IS NOT NULL AND $5::text IS NOT NULL
    ON CONFLICT DO NOTHING
)
INSERT INTO notify_delivery_member (delivery_id, event_id, alarm_id) VALUES ($1, $2, $3)
ON CONFLICT DO NOTHING;

-- name: repeat_due
-- $1 limit; groups whose latest window was sent and that are due a repeat (locked, skipping
-- those another node holds): repeat_interval_s after that send
-- (unless the group stopped repeating), or, owed one by a shelf's end (`resume_at`), at that
-- end but no sooner than group_interval_s after the latest window was due (`resuming`;
-- `interval_due`: the other). A latest window SUPPRESSED is a held window its wake emptied
-- (every alarm in it shelved by then: drop_from_window), ended then and never sent: the
-- group's repeats go on from it as from a send, or the group's open alarms of earlier windows
-- were never repeated again, nor a shelf's end over one of them told.
SELECT g.id, g.receiver, g.group_key, g.labels::text AS labels, g.windows,
       g.window_delivery_id, g.window_due_at, g.repeat_interval_s, g.group_interval_s,
       g.resume_alarm_ids, g.route_identity,
       d.outbox_id, d.event_created_at, d.device_id, d.rule_key, d.severity,
       (g.resume_at IS NOT NULL
        AND greatest(g.resume_at, g.window_due_at + make_interval(secs => g.group_interval_s))
            <= now()) AS resuming,
       (NOT g.repeat_stopped
        AND d.finished_at + make_interval(secs => g.repeat_interval_s) <= now())
           AS interval_due
FROM notify_group g JOIN notify_delivery d ON d.id = g.window_delivery_id
WHERE g.repeat_interval_s > 0 AND d.status IN ('SENT', 'SUPPRESSED')
  AND ((NOT g.repeat_stopped
        AND d.finished_at + make_interval(secs => g.repeat_interval_s) <= now())
       OR (g.resume_at IS NOT NULL
           AND greatest(g.resume_at,
                        g.window_due_at + make_interval(secs => g.group_interval_s)) <= now()))
ORDER BY g.id
LIMIT $1
FOR UPDATE OF g SKIP LOCKED;

-- name: stop_repeating
-- $1 group id; none of its alarms is open and unshelved any more: no repeat until a new
-- window, or a shelf's end.
UPDATE notify_group
SET repeat_stopped = true, resume_at = NULL, resume_alarm_ids = NULL
WHERE id = $1;

-- name: groups_to_retime
-- no parameters; every group, with what a reload re-times it by (gateway.domain.notify's
-- route_of_group): its receiver, key, labels and route identity, and its intervals now.
SELECT id, receiver, group_key, labels::text AS labels, route_identity, repeat_interval_s,
       group_interval_s
FROM notify_group;

-- name: retime_groups
-- $1 group ids, $2 repeat intervals, $3 group intervals (seconds): the intervals a reload
-- gives the stored groups, those of the route each repeats for now (route_of_group; 0, and
-- no shelf's end owed, for a group no grouping route makes any more for its receiver:
-- repeat_due passes it over). A group takes the intervals of a route's new window anyway
-- (set_window); this is for the groups whose alarms are still open, which may get none.
-- Only those changed are locked, in the order every other locker takes groups (receiver,
-- key; code-point order: the consumer's add, resume_groups): in id order it held a group a
-- consumer adding to two groups waited for while it waited for the consumer's other one, a
-- deadlock. The number changed.
WITH given AS (
    SELECT * FROM unnest($1::bigint[], $2::float8[], $3::float8[]) AS x(id, repeat_s, interval_s)
), changed AS (
    SELECT g.id, x.repeat_s, x.interval_s
    FROM notify_group g JOIN given x ON x.id = g.id
    WHERE g.repeat_interval_s <> x.repeat_s OR g.group_interval_s <> x.interval_s
    ORDER BY g.receiver COLLATE "C", g.group_key COLLATE "C"
    FOR UPDATE OF g
)
UPDATE notify_group g
SET repeat_interval_s = c.repeat_s, group_interval_s = c.interval_s,
    resume_at = CASE WHEN c.repeat_s = 0 THEN NULL ELSE g.resume_at END,
    resume_alarm_ids = CASE WHEN c.repeat_s = 0 THEN NULL ELSE g.resume_alarm_ids END
FROM changed c
WHERE g.id = c.id;

-- name: wake_stopped_groups
-- no parameters; after a reload's retime (its own statement, not in retime_groups's
-- transaction): the groups that stopped repeating while an alarm they carried is still open
-- repeat again if they repeat at all. A repeat's list depends on the routes (a route edited
-- so that it no longer accepts a group's alarms leaves them out and the group stops); a
-- reload that puts them back (the edit reverted) must bring their reminders back, as a
-- route removed and put back does (its groups re-timed to 0 and back). A group with nothing
-- to list when due stops again at its next pass. An alarm shelved now does not count: such
-- a group would list nothing (a shelved alarm sends no notifications), and a shelf's end
-- owes its group a repeat of its own; a fleet's groups stopped under a maintenance shelf
-- would each make an empty pass at every start and reload (100,000 of them: 2.2 s to wake,
-- then 2,000 consumer passes of 50). Locked in the consumer's order (receiver, key;
-- code-point order). The number woken.
WITH woken AS (
    SELECT g.id FROM notify_group g
    WHERE g.repeat_stopped AND g.repeat_interval_s > 0
      AND EXISTS (
          SELECT 1 FROM notify_group_member m JOIN alarm a ON a.id = m.alarm_id
          WHERE m.group_id = g.id
            AND a.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED')
            AND alarm_shelved_until(a.id, a.device_id, a.rule_key, now()) IS NULL)
    ORDER BY g.receiver COLLATE "C", g.group_key COLLATE "C"
    FOR UPDATE OF g
)
UPDATE notify_group g SET repeat_stopped = false
FROM woken WHERE g.id = woken.id;

-- name: drop_resume
-- $1 group id; the repeat a shelf's end owed it is owed no more (what it freed is closed, or
-- shelved again).
UPDATE notify_group SET resume_at = NULL, resume_alarm_ids = NULL WHERE id = $1;

-- name: resume_groups
-- $1 shelf id (ended, in the caller's transaction); the groups owed a repeat by its end: those
-- a window of which carried an alarm (notify_group_member) the shelf covered (the shelved alarm, or the pair's)
-- still open and no longer shelved, if they repeat. Each records when the shelf ended and
-- those alarms (with any an earlier end freed, not yet repeated). The groups are locked in
-- the consumer's order (receiver, key; code-point order as Python sorts): no circular wait
-- with a consumer adding to several of them.
WITH covered AS (
    SELECT a.id, a.device_id, a.rule_key, a.status, s.ended_at
    FROM alarm_shelf s JOIN alarm a ON a.id = s.alarm_id
    WHERE s.id = $1 AND s.scope = 'alarm'
    UNION ALL
    SELECT a.id, a.device_id, a.rule_key, a.status, s.ended_at
    FROM alarm_shelf s JOIN alarm a ON a.device_id = s.device_id AND a.rule_key = s.rule_key
    WHERE s.id = $1 AND s.scope = 'pair'
), freed AS (
    SELECT d.group_id, array_agg(DISTINCT c.id ORDER BY c.id) AS alarm_ids,
           min(c.ended_at) AS ended_at
    FROM covered c
    JOIN notify_group_member d ON d.alarm_id = c.id
    WHERE c.ended_at IS NOT NULL
      AND c.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED')
      AND alarm_shelved_until(c.id, c.device_id, c.rule_key, c.ended_at) IS NULL
      -- A window of the group carrying the alarm and not yet sent (a held window waiting
      -- for the wake, a window in its wait or being retried) tells it itself, after the end:
      -- a repeat owed for it would tell it again group_interval_s later.
      AND NOT EXISTS (
          SELECT 1 FROM notify_delivery_member dm
          JOIN notify_delivery w ON w.id = dm.delivery_id
          WHERE dm.alarm_id = c.id AND w.group_id = d.group_id
            AND w.status IN ('PENDING', 'SENDING'))
    GROUP BY d.group_id
), locked AS (
    SELECT g.id FROM notify_group g JOIN freed f ON f.group_id = g.id
    WHERE g.repeat_interval_s > 0
    ORDER BY g.receiver COLLATE "C", g.group_key COLLATE "C"
    FOR UPDATE OF g
)
UPDATE notify_group g
SET resume_at = coalesce(g.resume_at, f.ended_at),
    resume_alarm_ids = ARRAY(
        SELECT DISTINCT x FROM unnest(coalesce(g.resume_alarm_ids, '{}') || f.alarm_ids) AS x
        ORDER BY x)
FROM locked l JOIN freed f ON f.group_id = l.id
WHERE g.id = l.id
RETURNING g.id;

-- name: shelf_returns
-- $1 shelf id (ended, in the caller's transaction). What its end owes the routes that do not
-- group (docs/notifications.md, "A shelf's end tells its alarms again"; ISA-18.2: an unshelved
-- alarm returns to annunciation): for each alarm the shelf covered (the shelved alarm, or the
-- pair's) that is still open (not cleared, not dealt with), shelved by no other shelf now,
-- and not raised while its device was out of service, and each receiver an ungrouped route
-- chose for it, whose newest notification of it (a return included) a shelf suppressed:
-- that notification (its delivery's body and facts) and the alarm as it is now. A shelf, not
-- only this one: a shelf renewed past its until (ended and replaced in one transaction), or
-- two shelves over one alarm, leave the notifications their first shelf suppressed to the
-- last end. An alarm told before the shelf, nothing suppressed since, is not here (its
-- newest was sent): the shelf's end is not a reminder; nor is one a return told already.
-- Found through the alarm (notify_delivery_alarm_idx), never by scanning the deliveries.
-- event_created_at: the suppressed notification's, so that its return is dated no earlier
-- (the return must be the newest afterwards, for the next end over the alarm).
WITH s AS (
    SELECT id, scope, alarm_id, device_id, rule_key FROM alarm_shelf
    WHERE id = $1 AND ended_at IS NOT NULL
), covered AS (
    SELECT a.* FROM s JOIN alarm a ON a.id = s.alarm_id WHERE s.scope = 'alarm'
    UNION ALL
    SELECT a.* FROM s JOIN alarm a ON a.device_id = s.device_id AND a.rule_key = s.rule_key
    WHERE s.scope = 'pair'
), open AS (
    SELECT c.* FROM covered c
    WHERE c.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED')
      AND c.cleared_at IS NULL
      AND alarm_shelved_until(c.id, c.device_id, c.rule_key, now()) IS NULL
      AND NOT device_out_of_service_at(c.device_id, c.triggered_at)
), newest AS (
    SELECT DISTINCT ON (d.alarm_id, d.receiver)
           d.event_id, d.outbox_id, d.event, d.receiver, d.body, d.alarm_id, d.device_id,
           d.rule_key, d.severity, d.status, d.suppressed, d.event_created_at
    FROM open o
    JOIN notify_delivery d ON d.alarm_id = o.id
    WHERE d.route_grouped = false
    ORDER BY d.alarm_id, d.receiver, d.event_created_at DESC, d.id DESC
)
SELECT n.event_id, n.outbox_id, n.event, n.receiver, n.body::text AS body, n.alarm_id,
       n.device_id, n.rule_key, n.severity, n.event_created_at,
       o.status, o.triggered_at, o.pushed_at, o.confirmed_at, o.confirmed_by, o.escalated_at,
       o.handled_at, o.handled_by, o.closed_at, o.closed_by, o.cleared_at
FROM newest n JOIN open o ON o.id = n.alarm_id
WHERE n.status = 'SUPPRESSED' AND n.suppressed LIKE 'shelved (shelf %)'
ORDER BY n.alarm_id, n.receiver;

-- name: group_open_members
-- $1 group id (locked); what its repeat lists: each alarm its windows carried that is still
-- open (not dealt with) and not shelved now (its own shelf or its pair's in force: a shelved
-- alarm sends no notifications, docs/behaviour.md §5), once however many of its
-- notifications the group carried (created, escalated, reminders ...): with the newest of
-- them (the last carried: the alarm as it stands), in the place of the first (the order its
-- alarms were first carried). Out of service needs no test here: an alarm raised while its
-- device was (what suppresses its notifications) joins no window. Deleted: the rows of alarms
-- dealt with (never open again) or gone, and an open alarm's rows between its first and its
-- newest (neither its place nor its body): the next repeat reads at most two rows an alarm.
-- Shelved is judged at this statement's time, not the transaction's: a shelf lifted (or made)
-- after the repeat pass began and committed before this statement is seen ended (or in force)
-- here, so it is judged so; at the transaction's time a lifted alarm counted as shelved,
-- the repeat left it out and, paying what the lift owed the group, cleared its debt.
-- An alarm a sibling of the group carried a newer notification of is that group's to repeat,
-- not this one's: a sibling is another group of the receiver made by the same route (its
-- route_identity: the held group, key `|held`, of an ordinary one and the other way round,
-- or the group of a key the route's new place in the list made), or, for a group with no
-- identity (made before migration 0047), its held or ordinary group by key. An alarm raised in
-- quiet hours (the held group) and escalated by day (the ordinary one) is listed once per
-- interval, as it stands, not twice. Only a sibling that repeats: one whose repeats are off,
-- or whose latest window FAILED (repeat_due passes it over until a new window), would remind
-- nobody of the alarm. Read from the alarm's own member rows (notify_group_member_alarm_idx),
-- never from the receiver's groups, which grouping by device makes many.
WITH me AS (
    SELECT g.receiver, g.route_identity,
           CASE WHEN g.group_key LIKE '%|held' THEN left(g.group_key, -5)
                ELSE g.group_key || '|held' END AS sibling_key
    FROM notify_group g WHERE g.id = $1
), m AS (
    SELECT m.event_id, m.alarm_id, m.seq,
           min(m.seq) OVER per_alarm AS first_seq, max(m.seq) OVER per_alarm AS last_seq,
           coalesce(a.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED'), false)
               AS open,
           a.device_id, a.rule_key
    FROM notify_group_member m LEFT JOIN alarm a ON a.id = m.alarm_id
    WHERE m.group_id = $1
    WINDOW per_alarm AS (PARTITION BY m.alarm_id)
), gone AS (
    DELETE FROM notify_group_member x USING m
    WHERE x.group_id = $1 AND x.event_id = m.event_id
      AND (NOT m.open OR m.seq NOT IN (m.first_seq, m.last_seq))
)
SELECT m.event_id, m.alarm_id, x.body::text AS body
FROM m JOIN notify_group_member x ON x.group_id = $1 AND x.event_id = m.event_id
WHERE m.open AND m.seq = m.last_seq
  AND alarm_shelved_until(m.alarm_id, m.device_id, m.rule_key, statement_timestamp()) IS NULL
  AND NOT EXISTS (
      SELECT 1
      FROM me, notify_group_member o
      JOIN notify_group s ON s.id = o.group_id
      JOIN notify_delivery w ON w.id = s.window_delivery_id
      WHERE o.alarm_id = m.alarm_id AND o.seq > m.seq AND o.group_id <> $1
        AND s.receiver = me.receiver
        AND (s.route_identity = me.route_identity OR s.group_key = me.sibling_key)
        AND s.repeat_interval_s > 0 AND w.status <> 'FAILED')
ORDER BY m.first_seq;

-- name: route_carries_alarm
-- $1 group id, $2 receiver, $3 route identity, $4 alarm id; whether another group of the
-- receiver made by that route (its route_identity) carries the alarm and reminds of it (it
-- repeats, its latest window not FAILED): then the group $1, which carries the alarm of a
-- route that moved off its place, leaves it to that group (one reminder per alarm and route).
SELECT EXISTS (
    SELECT 1 FROM notify_group_member m
    JOIN notify_group s ON s.id = m.group_id
    JOIN notify_delivery w ON w.id = s.window_delivery_id
    WHERE m.alarm_id = $4 AND m.group_id <> $1 AND s.receiver = $2
      AND s.route_identity = $3 AND s.repeat_interval_s > 0 AND w.status <> 'FAILED');

-- name: delivery_alarms
-- $1 delivery id; the alarms a window's delivery carries.
SELECT DISTINCT alarm_id FROM notify_delivery_member
WHERE delivery_id = $1 AND alarm_id IS NOT NULL ORDER BY alarm_id;

-- name: claim_due
-- $1 receiver, $2 node id, $3 lease seconds, $4 at most. Due PENDING deliveries of the
-- receiver, and SENDING ones whose lease ran out (their sender died): SENDING with this
-- node's lease, one attempt more (the generation the finishing write names). Never one of
-- an alarm that quiet hours hold (DELAYED), nor a window carrying one: the wake releases
-- those.
-- `claimed_at`: the database's time of the claim, which dates the attempt's signature (a
-- node's own clock may be minutes off; a receiver refuses a signature dated so).
WITH due AS (
    SELECT id FROM notify_delivery
    WHERE receiver = $1
      AND ((status = 'PENDING' AND next_attempt_at <= now())
           OR (status = 'SENDING' AND lease_until < now()))
      AND (alarm_id IS NULL OR NOT EXISTS (
          SELECT 1 FROM alarm a WHERE a.id = alarm_id AND a.status = 'DELAYED'))
      AND (group_id IS NULL OR NOT EXISTS (
          SELECT 1 FROM notify_delivery_member m JOIN alarm a ON a.id = m.alarm_id
          WHERE m.delivery_id = notify_delivery.id AND a.status = 'DELAYED'))
    ORDER BY next_attempt_at, id
    LIMIT $4
    FOR UPDATE SKIP LOCKED
)
UPDATE notify_delivery d
SET status = 'SENDING', lease_owner = $2, lease_until = now() + make_interval(secs => $3),
    attempts = d.attempts + 1
FROM due
WHERE d.id = due.id
RETURNING d.id, d.event_id, d.event, d.receiver, d.body::text AS body, d.attempts,
          d.severity, d.rule_key, d.device_id, d.alarm_id, d.event_created_at, d.created_at,
          now() AS claimed_at, d.group_id, d.recipients_owed, d.recipients_missed;

-- name: finish_sent
-- $1 id, $2 node id, $3 attempt, $4 what the receiver refused of it (recipients) or null;
-- only the claim that is still this node's attempt. Its latency: seconds from its event's
-- creation to now, both on the database's clock (a node's own may be minutes off).
UPDATE notify_delivery
SET status = 'SENT', finished_at = now(), lease_until = NULL, sent_by = $2, last_error = $4::text
WHERE id = $1 AND status = 'SENDING' AND lease_owner = $2 AND attempts = $3
RETURNING extract(epoch FROM finished_at - event_created_at)::float8 AS latency_s;

-- name: finish_partly
-- $1 id, $2 node id, $3 attempt, $4 retry in seconds, $5 the recipients still owed the mail
-- (refused for now: a greylisting 451), $6 those refused for good so far, $7 the error. An
-- e-mail some recipients took: PENDING again, for those alone. The delivery's latency to
-- this first acceptance (as finish_sent's).
UPDATE notify_delivery
SET status = 'PENDING', next_attempt_at = now() + make_interval(secs => $4),
    recipients_owed = $5::text[], recipients_missed = $6::text, last_error = $7,
    lease_owner = NULL, lease_until = NULL
WHERE id = $1 AND status = 'SENDING' AND lease_owner = $2 AND attempts = $3
RETURNING extract(epoch FROM now() - event_created_at)::float8 AS latency_s;

-- name: finish_retry
-- $1 id, $2 node id, $3 attempt, $4 retry in seconds, $5 error.
UPDATE notify_delivery
SET status = 'PENDING', next_attempt_at = now() + make_interval(secs => $4), last_error = $5,
    lease_owner = NULL, lease_until = NULL
WHERE id = $1 AND status = 'SENDING' AND lease_owner = $2 AND attempts = $3
RETURNING id;

-- name: finish_failed
-- $1 id, $2 node id, $3 attempt, $4 error; no attempts left.
UPDATE notify_delivery
SET status = 'FAILED', finished_at = now(), last_error = $4, lease_until = NULL
WHERE id = $1 AND status = 'SENDING' AND lease_owner = $2 AND attempts = $3
RETURNING id;

-- name: wake_deferring_groups
-- $1 a grouped window just FAILED (in the caller's transaction). If it is its group's latest
-- (repeat_due passes the group over until a new window), the groups of the same route for
-- the receiver (group_open_members's siblings: same route_identity, or the key's held or
-- ordinary group) that stopped repeating while they left out an alarm this group carried a
-- newer notification of (nothing else left) repeat again: they remind of it now, or nobody
-- would (docs/notifications.md, "One reminder per alarm and route"). Locked in the
-- consumer's order (receiver, key; code-point order). The number woken.
WITH failed AS (
    SELECT g.id, g.receiver, g.route_identity,
           CASE WHEN g.group_key LIKE '%|held' THEN left(g.group_key, -5)
                ELSE g.group_key || '|held' END AS sibling_key
    FROM notify_group g JOIN notify_delivery w ON w.id = g.window_delivery_id
    WHERE w.id = $1 AND w.status = 'FAILED'
), woken AS (
    SELECT s.id FROM failed f JOIN notify_group s
      ON s.receiver = f.receiver AND s.id <> f.id
     AND (s.route_identity = f.route_identity OR s.group_key = f.sibling_key)
    WHERE s.repeat_stopped AND s.repeat_interval_s > 0
      AND EXISTS (
          SELECT 1 FROM notify_group_member m JOIN notify_group_member o
            ON o.alarm_id = m.alarm_id AND o.group_id = f.id
          WHERE m.group_id = s.id)
    ORDER BY s.receiver COLLATE "C", s.group_key COLLATE "C"
    FOR UPDATE OF s
)
UPDATE notify_group g SET repeat_stopped = false
FROM woken WHERE g.id = woken.id;

-- name: pending_stats
-- no parameters; open deliveries and the age in seconds of the oldest one.
SELECT count(*) AS pending,
       coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_age_s
FROM notify_delivery WHERE status IN ('PENDING', 'SENDING');

-- name: insert_silence
-- $1 matchers json, $2 ends at, $3 comment, $4 created by. An end already past ends it now;
-- one past the end of year 9999 (UTC) is moved there (what a client can read back).
INSERT INTO notify_silence (matchers, ends_at, comment, created_by)
VALUES ($1::jsonb, least(greatest($2, now()), '9999-12-31 23:59:59.999999+00'), $3, $4)
RETURNING id, matchers::text AS matchers, starts_at, ends_at, comment, created_by, created_at,
          expired_by, (ends_at > now()) AS active;

-- name: list_silences
-- $1 only active ones, $2 before id (null: from the newest), $3 limit; newest first.
SELECT id, matchers::text AS matchers, starts_at, ends_at, comment, created_by, created_at,
       expired_by, (ends_at > now()) AS active
FROM notify_silence
WHERE (NOT $1 OR ends_at > now()) AND ($2::bigint IS NULL OR id < $2)
ORDER BY id DESC
LIMIT $3;

-- name: get_silence
-- $1 id.
SELECT id, matchers::text AS matchers, starts_at, ends_at, comment, created_by, created_at,
       expired_by, (ends_at > now()) AS active
FROM notify_silence WHERE id = $1;

-- name: expire_silence
-- $1 id, $2 who; ends an active silence now (an ended one is left as it is).
UPDATE notify_silence SET ends_at = now(), expired_by = $2
WHERE id = $1 AND ends_at > now()
RETURNING id;

-- name: list_deliveries
-- $1 status or null, $2 receiver or null, $3 event or null, $4 before id or null, $5 limit.
SELECT id, event_id, outbox_id, event, receiver, alarm_id, device_id, rule_key, severity,
       status, attempts, next_attempt_at, last_error, silence_id, suppressed, sent_by,
       event_created_at, created_at, finished_at, inhibited_by, inhibit_rule, group_id
FROM notify_delivery
WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR receiver = $2)
  AND ($3::text IS NULL OR event = $3) AND ($4::bigint IS NULL OR id < $4)
ORDER BY id DESC
LIMIT $5;

-- name: get_delivery
-- $1 id; with its body.
SELECT id, event_id, outbox_id, event, receiver, alarm_id, device_id, rule_key, severity,
       status, attempts, next_attempt_at, last_error, silence_id, suppressed, sent_by,
       event_created_at, created_at, finished_at, inhibited_by, inhibit_rule, group_id,
       body::text AS body
FROM notify_delivery WHERE id = $1;
