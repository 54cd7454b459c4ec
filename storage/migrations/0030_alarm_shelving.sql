-- The alarm desk (docs/behaviour.md §5, "Shelving" and "Out of service"): shelves and
-- maintenance periods. Neither is a status: the nine states stay as they are. Whether an alarm
-- is shelved, or was raised while its device was out of service, is read from these tables
-- (the functions below), so creating an alarm writes nothing more than before.

-- A shelf: one alarm (alarm_id), or every alarm of a (device, rule) pair, present and future,
-- taken off the main view and kept from notifications until `until`, or until it ends first
-- (lifted by a person). It ends by itself: a timer on any node writes ended_at = until, once
-- (a conditional write on ended_at IS NULL). The row is its own record: who, why, until when,
-- who ended it; every alarm it covered also has an audit row for each step.
CREATE TABLE alarm_shelf (
    id          bigserial PRIMARY KEY,
    scope       text NOT NULL CHECK (scope IN ('alarm', 'pair')),
    alarm_id    bigint REFERENCES alarm (id),
    device_id   text NOT NULL,
    rule_key    text NOT NULL,
    reason      text NOT NULL CHECK (reason ~ '\S'),
    shelved_by  text NOT NULL CHECK (shelved_by ~ '\S'),
    shelved_at  timestamptz NOT NULL DEFAULT now(),
    until       timestamptz NOT NULL,
    node_id     text NOT NULL,
    request_id  text,
    ended_at    timestamptz,
    ended_by    text,
    end_reason  text CHECK (end_reason IN ('expired', 'lifted')),
    CONSTRAINT alarm_shelf_scope_has_alarm CHECK ((scope = 'alarm') = (alarm_id IS NOT NULL)),
    CONSTRAINT alarm_shelf_until_after_start CHECK (until > shelved_at),
    CONSTRAINT alarm_shelf_end_complete CHECK (
        (ended_at IS NULL) = (ended_by IS NULL) AND (ended_at IS NULL) = (end_reason IS NULL)),
    CONSTRAINT alarm_shelf_end_not_before_start CHECK (ended_at IS NULL OR ended_at >= shelved_at)
);

-- At most one shelf not ended per alarm, and per pair.
CREATE UNIQUE INDEX alarm_shelf_one_per_alarm ON alarm_shelf (alarm_id)
    WHERE ended_at IS NULL AND scope = 'alarm';
CREATE UNIQUE INDEX alarm_shelf_one_per_pair ON alarm_shelf (device_id, rule_key)
    WHERE ended_at IS NULL AND scope = 'pair';
-- The expiry timer: shelves not ended, by due time.
CREATE INDEX alarm_shelf_due_idx ON alarm_shelf (until, id) WHERE ended_at IS NULL;
-- Whether an alarm was shelved at a time (the notify consumer asks for each alarm event).
CREATE INDEX alarm_shelf_alarm_idx ON alarm_shelf (alarm_id) WHERE alarm_id IS NOT NULL;
CREATE INDEX alarm_shelf_pair_idx ON alarm_shelf (device_id, rule_key) WHERE scope = 'pair';

-- Out of service (maintenance): one row per period. A period is in force from `since` until
-- it ended (DELETE) or its `until` passed, whichever is first. Alarms raised in a period are
-- created as ever; their notifications are suppressed.
CREATE TABLE device_out_of_service (
    id         bigserial PRIMARY KEY,
    device_id  text NOT NULL REFERENCES device (device_id),
    reason     text NOT NULL CHECK (reason ~ '\S'),
    set_by     text NOT NULL CHECK (set_by ~ '\S'),
    since      timestamptz NOT NULL DEFAULT now(),
    until      timestamptz,
    request_id text,
    ended_at   timestamptz,
    ended_by   text,
    CONSTRAINT device_oos_until_after_since CHECK (until IS NULL OR until > since),
    CONSTRAINT device_oos_end_complete CHECK ((ended_at IS NULL) = (ended_by IS NULL)),
    CONSTRAINT device_oos_end_not_before_since CHECK (ended_at IS NULL OR ended_at >= since)
);

-- At most one period not ended per device (a new one ends the previous one first).
CREATE UNIQUE INDEX device_oos_one_open ON device_out_of_service (device_id)
    WHERE ended_at IS NULL;
CREATE INDEX device_oos_device_idx ON device_out_of_service (device_id, since);

-- Until when the alarm is shelved as of `at` (null: not shelved then).
CREATE FUNCTION alarm_shelved_until(p_alarm_id bigint, p_device_id text, p_rule_key text,
                                    p_at timestamptz)
RETURNS timestamptz LANGUAGE sql STABLE AS $$
    SELECT max(least(s.until, coalesce(s.ended_at, 'infinity'::timestamptz)))
    FROM alarm_shelf s
    WHERE ((s.scope = 'alarm' AND s.alarm_id = p_alarm_id)
           OR (s.scope = 'pair' AND s.device_id = p_device_id AND s.rule_key = p_rule_key))
      AND s.shelved_at <= p_at
      AND p_at < least(s.until, coalesce(s.ended_at, 'infinity'::timestamptz))
$$;

-- Whether the device was out of service at `at`.
CREATE FUNCTION device_out_of_service_at(p_device_id text, p_at timestamptz)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM device_out_of_service o
        WHERE o.device_id = p_device_id
          AND o.since <= p_at
          AND p_at < least(coalesce(o.until, 'infinity'::timestamptz),
                           coalesce(o.ended_at, 'infinity'::timestamptz)))
$$;

-- Notifications an alarm's shelf or its device's maintenance kept from being sent: final,
-- visible, never sent (as SILENCED ones), with why in `suppressed` ('shelved: shelf 12',
-- 'out of service').
ALTER TABLE notify_delivery ADD COLUMN suppressed text;
ALTER TABLE notify_delivery DROP CONSTRAINT notify_delivery_status_check;
ALTER TABLE notify_delivery ADD CONSTRAINT notify_delivery_status_check
    CHECK (status IN ('PENDING', 'SENDING', 'SENT', 'FAILED', 'SILENCED', 'INHIBITED', 'SUPPRESSED'));
ALTER TABLE notify_delivery DROP CONSTRAINT notify_delivery_final_has_time;
ALTER TABLE notify_delivery ADD CONSTRAINT notify_delivery_final_has_time
    CHECK ((status IN ('SENT', 'FAILED', 'SILENCED', 'INHIBITED', 'SUPPRESSED')) = (finished_at IS NOT NULL));
ALTER TABLE notify_delivery ADD CONSTRAINT notify_delivery_suppressed_has_reason
    CHECK ((status = 'SUPPRESSED') = (suppressed IS NOT NULL));
