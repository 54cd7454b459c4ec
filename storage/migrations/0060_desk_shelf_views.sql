-- The shelves in force now, one row per shelved alarm and one per shelved (device, rule) pair,
-- with when the longest of them ends: what the desk's list, groups and counts join
-- (storage/queries/desk.sql), written there three times before. Plain views: the planner
-- expands each into the query that reads it, as the subqueries they replace were.
CREATE VIEW alarm_shelf_by_alarm AS
SELECT s.alarm_id, max(least(s.until, coalesce(s.ended_at, 'infinity'::timestamptz))) AS ends
FROM alarm_shelf s
WHERE s.scope = 'alarm' AND s.shelved_at <= now()
  AND now() < least(s.until, coalesce(s.ended_at, 'infinity'::timestamptz))
GROUP BY s.alarm_id;

CREATE VIEW alarm_shelf_by_pair AS
SELECT s.device_id, s.rule_key,
       max(least(s.until, coalesce(s.ended_at, 'infinity'::timestamptz))) AS ends
FROM alarm_shelf s
WHERE s.scope = 'pair' AND s.shelved_at <= now()
  AND now() < least(s.until, coalesce(s.ended_at, 'infinity'::timestamptz))
GROUP BY s.device_id, s.rule_key;
