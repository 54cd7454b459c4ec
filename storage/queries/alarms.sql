-- name: find_by_dedup
-- $1 dedup key; the alarm one telemetry event already raised for one rule, if any.
SELECT id FROM alarm WHERE dedup_key = $1;

-- name: lock_active
-- $1 active key; the alarm holding it, locked for the supersede decision.
SELECT id, status FROM alarm WHERE active_key = $1 FOR UPDATE;

-- name: supersede
-- $1 id, $2 expected status, $3 at; nobody attended: superseded, key released. Never before
-- the alarm's own trigger time: another node's transaction may have started earlier.
UPDATE alarm
SET status = 'SUPERSEDED', superseded_at = greatest($3, triggered_at), active_key = NULL
WHERE id = $1 AND status = $2
RETURNING id;

-- name: release_key
-- $1 id, $2 expected status; a person is on it: only the active key is released.
UPDATE alarm SET active_key = NULL WHERE id = $1 AND status = $2 RETURNING id;

-- name: lock_active_many
-- $1 active keys; the alarms holding them, locked for the supersede decision in one fixed
-- order (by active key), as `lock_active` does for one.
SELECT a.id, a.status, a.active_key
FROM unnest($1::text[]) AS k(key)
JOIN alarm a ON a.active_key = k.key
ORDER BY a.active_key
FOR UPDATE OF a;

-- name: supersede_many
-- $1 ids, $2 expected statuses (pairwise), $3 at; `supersede` for many: the ids superseded
-- (fewer than asked: one changed meanwhile).
UPDATE alarm a
SET status = 'SUPERSEDED', superseded_at = greatest($3, a.triggered_at), active_key = NULL
FROM unnest($1::bigint[], $2::text[]) AS u(id, status)
WHERE a.id = u.id AND a.status = u.status
RETURNING a.id;

-- name: release_keys
-- $1 ids, $2 expected statuses (pairwise); `release_key` for many: the ids released.
UPDATE alarm a SET active_key = NULL
FROM unnest($1::bigint[], $2::text[]) AS u(id, status)
WHERE a.id = u.id AND a.status = u.status
RETURNING a.id;

-- name: link_superseded_many
-- $1 superseded ids, $2 the ids that replaced them (pairwise); the superseded rows.
UPDATE alarm a SET superseded_by = u.new_id
FROM unnest($1::bigint[], $2::bigint[]) AS u(old_id, new_id)
WHERE a.id = u.old_id AND a.status = 'SUPERSEDED'
RETURNING a.*;

-- name: insert_supersede_audits
-- $1 alarm ids, $2 their statuses before, $3 the telemetry event ids that superseded them
-- (arrays, pairwise), $4 actor, $5 node id.
INSERT INTO alarm_audit (alarm_id, actor, action, from_status, to_status, event_id, node_id)
SELECT a, $4, 'supersede', f, 'SUPERSEDED', e, $5
FROM unnest($1::bigint[], $2::text[], $3::text[]) AS u(a, f, e);

-- name: insert_alarm
-- $1 device, $2 rule key, $3 severity, $4 telemetry event id, $5 dedup key, $6 active key,
-- $7 triggered at, $8 node id, $9 trigger json or null, $10 rule description or null, $11
-- reason (why the rule fired); nothing on a dedup hit.
INSERT INTO alarm (device_id, rule_key, severity, status, telemetry_event_id, dedup_key,
                   active_key, triggered_at, node_id, trigger, rule_description, reason)
VALUES ($1, $2, $3, 'NEW', $4, $5, $6, $7, $8, $9::jsonb, $10, $11)
ON CONFLICT (dedup_key) DO NOTHING
RETURNING *;

-- name: taken_keys
-- $1 dedup keys, $2 active keys; those some alarm already has (dedup hits) or holds now.
-- Joins on unnest, not "= ANY($1)": the prepared (generic) plan of the latter scanned the
-- whole table, 65 ms per call at 20,000 alarms.
SELECT ARRAY(SELECT a.dedup_key FROM unnest($1::text[]) AS k(key)
             JOIN alarm a ON a.dedup_key = k.key) AS dedup_hits,
       ARRAY(SELECT a.active_key FROM unnest($2::text[]) AS k(key)
             JOIN alarm a ON a.active_key = k.key) AS held;

-- name: insert_alarms
-- $1 devices, $2 rule keys, $3 severities, $4 telemetry event ids, $5 dedup keys, $6 active
-- keys (arrays, pairwise), $7 triggered at, $8 node id, $9 triggers json, $10 rule
-- descriptions, $11 reasons (arrays, pairwise with the others, nulls allowed); the rows
-- inserted (none on a dedup hit).
INSERT INTO alarm (device_id, rule_key, severity, status, telemetry_event_id, dedup_key,
                   active_key, triggered_at, node_id, trigger, rule_description, reason)
SELECT d, r, s, 'NEW', e, k, a, $7, $8, g::jsonb, x, w
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
            $9::text[], $10::text[], $11::text[])
     AS u(d, r, s, e, k, a, g, x, w)
ON CONFLICT (dedup_key) DO NOTHING
RETURNING *;

-- name: insert_creation_audits
-- $1 alarm ids, $2 to statuses, $3 telemetry event ids (arrays, pairwise), $4 actor, $5 node
-- id; the audit rows of new alarms (no from status, note or request id).
INSERT INTO alarm_audit (alarm_id, actor, action, from_status, to_status, event_id, node_id)
SELECT a, $4, 'create', NULL, t, e, $5
FROM unnest($1::bigint[], $2::text[], $3::text[]) AS u(a, t, e);

-- name: link_superseded
-- $1 superseded id, $2 the id that replaced it.
UPDATE alarm SET superseded_by = $2 WHERE id = $1 AND status = 'SUPERSEDED';

-- name: clear_active
-- $1 active key, $2 cleared at, $3 clear event id; recovery is an attribute, never a status.
-- Never before the alarm's trigger time (another node's transaction may have started later).
UPDATE alarm
SET cleared_at = greatest($2, triggered_at), clear_event_id = $3
WHERE active_key = $1 AND cleared_at IS NULL
RETURNING id, device_id, rule_key, status, cleared_at, trigger::text AS trigger, rule_description;

-- name: clear_one
-- $1 id, $2 cleared at, $3 clear event id; the alarm just raised by a late occurrence whose
-- clear committed before it (the newer alarm it would have joined had ended): cleared by that
-- clear, as `clear_active` clears (never before its trigger time, never twice).
UPDATE alarm
SET cleared_at = greatest($2, triggered_at), clear_event_id = $3
WHERE id = $1 AND cleared_at IS NULL
RETURNING id, device_id, rule_key, status, cleared_at, trigger::text AS trigger, rule_description;

-- name: get
-- $1 id.
SELECT * FROM alarm WHERE id = $1;

-- name: lock
-- $1 id; the alarm, locked until the caller commits: a transition reads the row it writes
-- back. A refire's key release (or a timer, or another person) committed first is what it
-- reads; one still running is waited for. The lock is the one an update of its other
-- columns takes (NO KEY UPDATE): an audit row of the alarm being written elsewhere (a key
-- share) does not wait for it.
SELECT * FROM alarm WHERE id = $1 FOR NO KEY UPDATE;

-- name: still_new
-- $1 ids; those of these alarms still NEW (one probe for every alarm a round of the console
-- stream wrote: almost always none, each already pushed), and not shelved now: the console
-- leaves a shelved alarm out of its list, so writing its creation reached nobody (it is
-- measured for "unreached" from its shelf's end, docs/behaviour.md §5).
SELECT id, device_id, severity FROM alarm
WHERE id = ANY($1::bigint[]) AND status = 'NEW'
  AND alarm_shelved_until(id, device_id, rule_key, now()) IS NULL
ORDER BY id;

-- name: update_lifecycle
-- $1 id, $2 expected (prior) status, then the new values: $3 status, $4 active key,
-- $5 pushed_at, $6 delayed_at, $7 woken_at, $8 confirmed_at, $9 confirmed_by,
-- $10 handled_at, $11 handled_by, $12 closed_at, $13 closed_by, $14 false_at, $15 false_by,
-- $16 escalated_at, $17 superseded_at, $18 superseded_by, $19 last_notified_at; $20 null, or
-- the latest confirmation the write is still for (the escalation: confirmed at or before its
-- due time; a person confirming again since restarts the clock, and a stale pass, one that
-- read its due alarms before, escalates nothing).
-- Zero rows: somebody changed the alarm first. A transition only ever releases the active key
-- (reaching a terminal state): it never gives one back, whatever was read (a refire may have
-- released it, and a new alarm taken it).
UPDATE alarm
SET status = $3, active_key = CASE WHEN $4::text IS NULL THEN NULL ELSE active_key END,
    pushed_at = $5, delayed_at = $6, woken_at = $7,
    confirmed_at = $8, confirmed_by = $9, handled_at = $10, handled_by = $11,
    closed_at = $12, closed_by = $13, false_at = $14, false_by = $15, escalated_at = $16,
    superseded_at = $17, superseded_by = $18, last_notified_at = $19
WHERE id = $1 AND status = $2 AND ($20::timestamptz IS NULL OR confirmed_at <= $20)
RETURNING *;

-- name: insert_audit
-- $1 alarm id, $2 actor, $3 action, $4 from status, $5 to status, $6 note, $7 request id,
-- $8 event id, $9 node id, $10 the actor the caller stated (untrusted) or null.
INSERT INTO alarm_audit (alarm_id, actor, action, from_status, to_status, note, request_id,
                         event_id, node_id, stated_actor)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10);

-- name: audit_of
-- $1 alarm id; its audit trail, oldest first.
SELECT id, actor, stated_actor, action, from_status, to_status, note, request_id, event_id,
       node_id, at
FROM alarm_audit WHERE alarm_id = $1 ORDER BY id;

-- name: now
-- no parameters; the database clock, the one clock every node shares.
SELECT now();

-- name: clock_now
-- no parameters; the database clock as this statement runs (clock_timestamp(): the moment, not
-- the transaction's start, which now() gives): when a step taken inside a transaction, after
-- waiting for locks, happened.
SELECT clock_timestamp();

-- name: clear_many
-- $1 active keys, $2 clear event id per key, $3 cleared at, $4 rule keys whose alarms are
-- cleared only if they are inactivity alarms (their trigger says since when the device was
-- silent: rules no longer configured as inactivity rules; usually none); recovery of many
-- alarms at once (a device heard from clears its inactivity alarms, whichever node raised
-- them, whatever rule). $5 when the device was heard if not now (a replayed dead letter's
-- receipt), else null: then only an alarm for a silence that began before it is cleared (an
-- old message says nothing of a silence after it). $6 per key, how long before this
-- statement the node read the device's newest message of the batch off the broker (seconds,
-- on its own clock; null: unknown), put on the database's clock as the presence's receipts
-- are (ingest.sql, upsert_presence): a message read before the silence began says nothing of
-- it either, whichever node stores it when (a node a batch behind storing the report it read
-- before the device's Will, after another node stored the Will). The silence began at the
-- alarm's silent_since, or, for the device's offline presence that raised it (the presence
-- stored then), when the Will was read (its receipt, before its batch's time). $7 true: a
-- device heard from, clearing its inactivity alarms: never one its trigger says a threshold
-- (`metric`) or an event (`event`) raised (a reload that made that rule an inactivity rule under the same key
-- leaves it to its own end: an SOS a carer is on, a boiler still hot, is not over because
-- the device was heard from); an alarm from before triggers were kept (none, or `{}`) is
-- taken for an inactivity alarm, as it always was.
UPDATE alarm a
SET cleared_at = greatest($3, a.triggered_at), clear_event_id = u.event_id
FROM unnest($1::text[], $2::text[], $6::float8[]) AS u(active_key, event_id, age)
WHERE a.active_key = u.active_key AND a.cleared_at IS NULL
  AND (a.rule_key <> ALL($4::text[]) OR a.trigger ? 'silent_since')
  AND (NOT $7::boolean OR a.trigger ? 'silent_since'
       OR NOT coalesce(a.trigger ?| ARRAY['metric', 'event'], false))
  AND ($5::timestamptz IS NULL
       OR (a.trigger ->> 'silent_since')::timestamptz < $5::timestamptz)
  AND (u.age IS NULL OR NOT a.trigger ? 'silent_since'
       OR statement_timestamp() - make_interval(secs => u.age) >= (
           SELECT CASE WHEN d.presence = 'offline'
                        AND d.presence_at = (a.trigger ->> 'silent_since')::timestamptz
                       THEN least(d.presence_at, coalesce(d.presence_received_at, d.presence_at))
                       ELSE (a.trigger ->> 'silent_since')::timestamptz END
           FROM device d WHERE d.device_id = a.device_id))
RETURNING a.id, a.device_id, a.rule_key, a.status, a.cleared_at, u.event_id,
          a.trigger::text AS trigger, a.rule_description;

-- name: uncleared_inactivity_rules
-- $1 the keys of the inactivity rules configured now; the keys of the other rules that hold
-- an uncleared inactivity alarm (its trigger says since when the device was silent): a
-- reload removed or renamed them, and the device's next message still clears the alarm. Read
-- by the active key's index (one row per device and rule at most).
SELECT DISTINCT rule_key FROM alarm
WHERE active_key IS NOT NULL AND cleared_at IS NULL AND trigger ? 'silent_since'
  AND rule_key <> ALL($1::text[]);

-- name: silent_devices
-- $1 silent seconds, $2 rule key, $3 and $4 the breaks of this node's listening: when each
-- began and ended, in seconds before now (began 'Infinity': before the node's first
-- subscribe, nothing before it was listened to), $5 the keys of the inactivity rules
-- configured now; devices whose retained presence says offline
-- (a statement, judged whatever the node heard), or that this node listened to for that long
-- without hearing them (the time since last_seen, less the breaks inside it), and not already
-- alarmed by this rule: an uncleared active alarm, or an alarm in any state for a silence
-- that began at or after last_seen (the device has not been heard from since: a presence
-- replayed by a lagging or restarted node moves presence_at, not the silence), by this rule
-- or by one no longer configured as an inactivity rule (renamed: the same silence), unless
-- this rule was configured beside it when it fired (its trigger's inactivity_rules: a rule
-- a reload removed, not this one renamed; each raises its own). `last_seen <
-- now() - $1` first: nobody listened to a device longer than it has been silent. The alarms
-- are read by device (alarm_device_idx); one raised before last_seen is no candidate.
-- $6 and $7 when an `offline` (a Will) read by this node says nothing of the device's death
-- (each window's earliest and latest receipt, in seconds before now; will_windows in
-- gateway/support/hearing.py): read about a break of this node's session, or while it
-- subscribed at its start. A broker going down publishes every connected device's Will as it
-- closes the node's connection too (mosquitto 2.0 does at its stop), and what the session
-- resumes with, or the retained status read at the subscribe, was published while the node
-- did not listen. By its receipt, or presence_at where no receipt is known. Such an
-- `offline` is no statement (`stated` false): the device is judged by its silence
-- (`silent`), as one not heard. $8 and $9: a page, the devices after that id (keyset on the
-- primary key), that many at most.
SELECT d.device_id, d.last_seen, d.presence, d.presence_at, o.stated, w.silent
FROM device d,
     LATERAL (SELECT extract(epoch FROM now() - d.last_seen)::float8 AS age) AS s,
     LATERAL (
         SELECT d.presence = 'offline' AND d.presence_at >= d.last_seen AS offline,
                extract(epoch FROM now() - coalesce(d.presence_received_at, d.presence_at))
                    ::float8 AS r,
                d.last_seen < now() - make_interval(secs => $1)
                AND s.age - (SELECT coalesce(sum(greatest(least(b.began, s.age) - b.ended, 0)), 0)
                             FROM unnest($3::float8[], $4::float8[]) AS b(began, ended)) >= $1
                    AS silent) AS w,
     LATERAL (
         SELECT w.offline AND NOT EXISTS (
                    SELECT 1 FROM unnest($6::float8[], $7::float8[]) AS u(earliest, latest)
                    WHERE w.r BETWEEN u.latest AND u.earliest) AS stated) AS o
WHERE d.device_id > $8
  AND d.bound
  AND (o.stated OR w.silent)
  AND NOT EXISTS (
      SELECT 1 FROM alarm a
      WHERE a.active_key = d.device_id || ':' || $2 AND a.cleared_at IS NULL)
  AND NOT EXISTS (
      SELECT 1 FROM alarm a
      WHERE a.device_id = d.device_id
        AND (a.rule_key = $2
             OR (a.rule_key <> ALL($5::text[])
                 AND NOT coalesce((a.trigger -> 'inactivity_rules') ? $2, false)))
        AND a.triggered_at >= d.last_seen
        AND (a.trigger ->> 'silent_since')::timestamptz >= d.last_seen)
ORDER BY d.device_id
LIMIT $9;

-- name: lock_unheard
-- $1 device id, $2 the last_seen its silence was judged from; the device's row, locked FOR
-- SHARE, if it has not been heard from since. A batch storing the device's message locks the
-- row to move last_seen (insert_telemetry): one that committed after the monitor read the
-- silence is seen here (no row: the silence is over, no alarm), and one still storing it
-- waits for this transaction, then finds the alarm to clear.
SELECT 1 FROM device WHERE device_id = $1 AND last_seen = $2 FOR SHARE;

-- name: delayed
-- $1 after id (keyset), $2 limit; alarms held back by quiet hours (rule_key: the wake waits
-- for a shelf's end over the pair, notify.sql hold_shelf_ends).
SELECT id, device_id, rule_key, severity FROM alarm
WHERE status = 'DELAYED' AND id > $1
ORDER BY id LIMIT $2;

-- name: suppress_held_deliveries
-- $1 alarm id, $2 now (its wake), $3 why (a shelf, out of service); the notifications of a
-- woken alarm, held while it was DELAYED, that its shelf (or its device's maintenance) keeps
-- from being sent: SUPPRESSED at the wake, as the consumer records one (final, never sent,
-- pushing nothing). The receivers of those suppressed. (One in a group's window is taken out
-- of it: held_window_members, drop_from_window.)
UPDATE notify_delivery
SET status = 'SUPPRESSED', suppressed = $3, finished_at = $2
WHERE alarm_id = $1 AND status = 'PENDING' AND attempts = 0
RETURNING receiver;

-- name: held_window_members
-- $1 alarm id; its notifications in group windows nobody has claimed yet (a held window,
-- waiting for the wake), the windows locked until the caller commits (a consumer adding to
-- one waits, then finds what this transaction left): the window, its receiver, each
-- notification's event id and body (as the window lists it), and its outbox row (the
-- window's first one if the event's was pruned).
WITH w AS (
    SELECT d.id, d.receiver, d.body, d.outbox_id FROM notify_delivery d
    WHERE d.id IN (SELECT delivery_id FROM notify_delivery_member WHERE alarm_id = $1)
      AND d.group_id IS NOT NULL AND d.status = 'PENDING' AND d.attempts = 0
    ORDER BY d.id
    FOR UPDATE
)
SELECT w.id AS delivery_id, w.receiver, m.event_id, n.value::text AS body,
       coalesce((SELECT o.id FROM outbox_event o WHERE o.event_id = m.event_id),
                w.outbox_id) AS outbox_id
FROM w
JOIN notify_delivery_member m ON m.delivery_id = w.id AND m.alarm_id = $1
CROSS JOIN LATERAL jsonb_array_elements(w.body -> 'notifications') AS n(value)
WHERE n.value ->> 'event_id' = m.event_id::text
ORDER BY w.id, m.event_id;

-- name: drop_from_window
-- $1 window's delivery id (locked), $2 event ids (uuid[]), $3 now, $4 why; those
-- notifications leave the window (its body and members) and its group (never sent in it:
-- its repeats do not list them); a window left with none is SUPPRESSED for that reason
-- (final, never sent). Its status after.
WITH gone AS (
    DELETE FROM notify_delivery_member
    WHERE delivery_id = $1 AND event_id = ANY($2::uuid[])
), ungrouped AS (
    DELETE FROM notify_group_member g
    USING notify_delivery w
    WHERE w.id = $1 AND g.group_id = w.group_id AND g.event_id = ANY($2::uuid[])
), kept AS (
    SELECT coalesce(jsonb_agg(n.value ORDER BY n.pos), '[]'::jsonb) AS notifications
    FROM notify_delivery x
    CROSS JOIN LATERAL jsonb_array_elements(x.body -> 'notifications')
        WITH ORDINALITY AS n(value, pos)
    WHERE x.id = $1 AND (n.value ->> 'event_id')::uuid <> ALL($2::uuid[])
)
UPDATE notify_delivery d
SET body = jsonb_set(jsonb_set(d.body, '{notifications}', k.notifications),
                     '{count}', to_jsonb(jsonb_array_length(k.notifications))),
    status = CASE WHEN jsonb_array_length(k.notifications) = 0 THEN 'SUPPRESSED'
                  ELSE d.status END,
    suppressed = CASE WHEN jsonb_array_length(k.notifications) = 0 THEN $4::text END,
    finished_at = CASE WHEN jsonb_array_length(k.notifications) = 0 THEN $3::timestamptz END
FROM kept k
WHERE d.id = $1
RETURNING d.status;

-- name: release_held_deliveries
-- $1 alarm id, $2 now; the notifications of a woken alarm, held while it was DELAYED: due
-- now. The count of those released.
-- A group's window of held alarms is made due too (still held while another of its alarms is
-- DELAYED: the claim skips it until that one is woken as well).
WITH released AS (
    UPDATE notify_delivery
    SET next_attempt_at = $2
    WHERE (alarm_id = $1 OR id IN (
               SELECT delivery_id FROM notify_delivery_member WHERE alarm_id = $1))
      AND status = 'PENDING' AND attempts = 0 AND next_attempt_at > $2
    RETURNING 1
)
SELECT count(*) FROM released;

-- name: lock_new_alarm
-- $1 id; the alarm if it is still NEW, locked until the caller commits: the quiet-hours
-- decision on it is taken by one transaction at a time (outbox publisher, notify consumer).
SELECT id, device_id, severity FROM alarm WHERE id = $1 AND status = 'NEW' FOR UPDATE;

-- name: has_deliveries
-- $1 alarm id; whether notifications of it were made already, on their own or in a group's
-- window (its quiet hours were decided by the consumer that made them).
SELECT EXISTS (SELECT 1 FROM notify_delivery WHERE alarm_id = $1)
    OR EXISTS (SELECT 1 FROM notify_delivery_member WHERE alarm_id = $1);

-- name: mark_unreached
-- $1 NEW since at or before, $2 now, $3 limit; NEW alarms that reached nobody in time, marked
-- once (another node's pass skips the rows this one holds, then finds them marked). An alarm
-- quiet hours held is NEW since its wake (`woken_at`), not since it fired: held on purpose,
-- it could reach nobody before (the pass that wakes it does not find it unreached). Nor is one
-- whose notifications are kept back on purpose: shelved now, or until less than the bound ago
-- (measured from its shelf's end, as from a wake), or raised while its device was out of
-- service (it notifies nobody, by design): each set found once (hashed), not looked for alarm
-- by alarm. The rows due
-- are found once and then looked up by id: joined to the table (UPDATE ... FROM (subquery)),
-- PostgreSQL, trusting statistics taken while the table was nearly empty, ran the locking
-- subquery again for every open NEW alarm, quadratic in them (206 ms a pass with 1,001 open
-- and none due; a test reads the plan).
WITH due AS (
    SELECT a.id FROM alarm a
    WHERE a.status = 'NEW' AND a.unreached_at IS NULL
      AND coalesce(a.woken_at, a.triggered_at) <= $1
      AND a.id NOT IN (
          SELECT s.alarm_id FROM alarm_shelf s
          WHERE s.scope = 'alarm' AND s.alarm_id IS NOT NULL AND s.shelved_at <= $2
            AND least(s.until, coalesce(s.ended_at, 'infinity'::timestamptz)) > $1)
      AND (a.device_id, a.rule_key) NOT IN (
          SELECT s.device_id, s.rule_key FROM alarm_shelf s
          WHERE s.scope = 'pair' AND s.device_id IS NOT NULL AND s.rule_key IS NOT NULL
            AND s.shelved_at <= $2
            AND least(s.until, coalesce(s.ended_at, 'infinity'::timestamptz)) > $1)
      AND a.id NOT IN (
          -- Driven by the periods (LATERAL): one look-up of a device's alarms a period.
          SELECT k.id FROM device_out_of_service o, LATERAL (
              SELECT k.id FROM alarm k
              WHERE k.device_id = o.device_id AND k.status = 'NEW' AND k.unreached_at IS NULL
                AND o.since <= k.triggered_at
                AND k.triggered_at < least(coalesce(o.until, 'infinity'::timestamptz),
                                           coalesce(o.ended_at, 'infinity'::timestamptz))
              OFFSET 0) k)  -- not flattened: the periods stay outside, the alarms inside
    ORDER BY a.id LIMIT $3
    FOR UPDATE OF a SKIP LOCKED
)
UPDATE alarm a SET unreached_at = $2
WHERE a.id = ANY (ARRAY(SELECT id FROM due)) AND a.status = 'NEW' AND a.unreached_at IS NULL
RETURNING a.id, a.device_id, a.rule_key, a.severity, a.triggered_at;

-- name: escalation_due
-- $1 confirmed at or before, $2 limit; confirmed and not handled in time.
SELECT id FROM alarm WHERE status = 'CONFIRMED' AND confirmed_at <= $1 ORDER BY id LIMIT $2;

-- name: reminder_due
-- $1 last notified at or before, $2 after id (keyset), $3 limit; open, unconfirmed, ringing
-- alarms due a reminder. One quiet hours held is notified at its wake (alarm.woken, and the
-- notifications released then): its reminders count from there, not from when it fired.
SELECT id, device_id, severity, status, last_notified_at FROM alarm
WHERE status IN ('NEW', 'PUSHED')
  AND greatest(coalesce(last_notified_at, pushed_at, triggered_at), woken_at) <= $1
  AND id > $2
ORDER BY id LIMIT $3;

-- name: mark_reminded
-- $1 id, $2 expected status, $3 expected last_notified_at, $4 now; no state change, and only
-- one node reminds (the previous reminder time is part of the condition).
UPDATE alarm SET last_notified_at = $4
WHERE id = $1 AND status = $2 AND last_notified_at IS NOT DISTINCT FROM $3
RETURNING *;

-- name: insert_late
-- $1 device, $2 rule key, $3 severity, $4 telemetry event id, $5 dedup key, $6 at, $7 node id,
-- $8 the dedup key of the alarm raised since, $9 clear event id or null, $10 trigger json or
-- null, $11 rule description or null, $12 reason; an alarm committed
-- after the alarm that, in device order, superseded it: created SUPERSEDED (and cleared,
-- with $9), holding no active key. Nothing on a dedup hit.
INSERT INTO alarm (device_id, rule_key, severity, status, telemetry_event_id, dedup_key,
                   active_key, triggered_at, superseded_at, superseded_by, cleared_at,
                   clear_event_id, node_id, trigger, rule_description, reason)
SELECT $1, $2, $3, 'SUPERSEDED', $4, $5, NULL, $6, $6,
       (SELECT id FROM alarm WHERE dedup_key = $8),
       CASE WHEN $9::text IS NULL THEN NULL ELSE $6::timestamptz END, $9, $7,
       $10::jsonb, $11, $12
ON CONFLICT (dedup_key) DO NOTHING
RETURNING *;

-- name: successor_open
-- $1 the dedup key of the alarm a late occurrence would be superseded by; true when that alarm
-- exists and is still open for people: not ended (CLOSED, FALSE, SUPERSEDED) nor HANDLED (a
-- person is done with it: what joined it would be shown to nobody, as a new SOS after an NTP
-- step hung off a handled one was). Only then may it stand for the occurrence.
SELECT EXISTS (
    SELECT 1 FROM alarm
    WHERE dedup_key = $1 AND status NOT IN ('CLOSED', 'FALSE', 'SUPERSEDED', 'HANDLED')
);

-- name: clear_raised_by
-- $1 device, $2 rule key, $3 device time, $4 cleared at, $5 clear event id; a late clear: the
-- newest alarm of (device, rule) raised by a sample at or before $3, if it has not cleared.
-- The sample's time is the one its trigger keeps (`sample_ts`, since migration 0010; migration
-- 0036 gave it to the older alarms whose sample was still stored). An alarm without it is
-- never the one.
UPDATE alarm
SET cleared_at = greatest($4, triggered_at), clear_event_id = $5
WHERE id = (
    SELECT a.id
    FROM alarm a
    CROSS JOIN LATERAL (SELECT (a.trigger ->> 'sample_ts')::timestamptz AS ts) AS raised
    WHERE a.device_id = $1 AND a.rule_key = $2 AND raised.ts <= $3
    ORDER BY raised.ts DESC, a.id DESC
    LIMIT 1
)
  AND cleared_at IS NULL
RETURNING id, device_id, rule_key, status, cleared_at, trigger::text AS trigger, rule_description;
