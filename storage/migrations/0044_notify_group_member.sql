-- A group's repeat lists every alarm of the group still open, however many windows ago it was
-- first sent (docs/notifications.md, "Repeat"); it used to list only its latest window's.
--
-- notify_group_member holds each notification a group's windows carried, once, with its body
-- as the window listed it, while its alarm may still be open: the repeat pass reads a group's
-- rows (its alarms open at the last repeat, and those carried since) and deletes those whose
-- alarm it finds dealt with (HANDLED, CLOSED, FALSE, SUPERSEDED: an alarm never reopens), so a
-- group's long history of closed alarms is read once, not at every repeat, and no window body
-- is read. A row outlives the window's delivery (retention) while the group lives. A route
-- that never repeats (repeat_interval_s = 0) keeps no rows.
-- Filled here from the windows' bodies of the groups that repeat, for the alarms open now.

CREATE TABLE notify_group_member (
    group_id bigint NOT NULL REFERENCES notify_group (id) ON DELETE CASCADE,
    event_id uuid NOT NULL,
    alarm_id bigint NOT NULL,
    -- The notification as the window listed it (a webhook body, protocol/notifications.py).
    body     jsonb NOT NULL,
    -- Order carried: a repeat lists the oldest first.
    seq      bigint GENERATED ALWAYS AS IDENTITY,
    PRIMARY KEY (group_id, event_id)
);

-- A shelf's end: the groups that carried an alarm it freed.
CREATE INDEX notify_group_member_alarm_idx ON notify_group_member (alarm_id);

INSERT INTO notify_group_member (group_id, event_id, alarm_id, body)
SELECT group_id, event_id, alarm_id, body
FROM (
    SELECT DISTINCT ON (d.group_id, m.event_id)
           d.group_id, m.event_id, m.alarm_id, n.value AS body, d.id AS delivery_id, n.pos
    FROM notify_delivery d
    JOIN notify_group g ON g.id = d.group_id AND g.repeat_interval_s > 0
    JOIN notify_delivery_member m ON m.delivery_id = d.id
    JOIN alarm a ON a.id = m.alarm_id
    CROSS JOIN LATERAL jsonb_array_elements(d.body -> 'notifications')
        WITH ORDINALITY AS n(value, pos)
    WHERE d.group_id IS NOT NULL
      AND a.status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED')
      AND n.value ->> 'event_id' = m.event_id::text
    ORDER BY d.group_id, m.event_id, d.id, n.pos
) first_carried
ORDER BY delivery_id, pos;
