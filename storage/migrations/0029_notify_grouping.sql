-- Notifications that do not flood (docs/notifications.md, "Grouping" and "Inhibition").
--
-- A grouped route's notifications for one receiver are gathered into windows of their group;
-- one delivery per window (event `notify.group`, its event_id derived from receiver, group and
-- window number, so the (event_id, receiver) uniqueness makes it exactly once across nodes)
-- carries them all, and `notify_delivery_member` says which events and alarms it carries.
-- An open alarm matching an inhibition rule makes a target's deliveries INHIBITED (final,
-- never sent), naming the inhibiting alarm.

ALTER TABLE notify_delivery DROP CONSTRAINT notify_delivery_status_check;
ALTER TABLE notify_delivery ADD CONSTRAINT notify_delivery_status_check
    CHECK (status IN ('PENDING', 'SENDING', 'SENT', 'FAILED', 'SILENCED', 'INHIBITED'));
ALTER TABLE notify_delivery DROP CONSTRAINT notify_delivery_final_has_time;
ALTER TABLE notify_delivery ADD CONSTRAINT notify_delivery_final_has_time CHECK (
    (status IN ('SENT', 'FAILED', 'SILENCED', 'INHIBITED')) = (finished_at IS NOT NULL));

ALTER TABLE notify_delivery ADD COLUMN inhibited_by bigint;
ALTER TABLE notify_delivery ADD COLUMN inhibit_rule text;
ALTER TABLE notify_delivery ADD CONSTRAINT notify_delivery_inhibited_has_source CHECK (
    (status = 'INHIBITED') = (inhibited_by IS NOT NULL));

-- One row per (receiver, group): the group's latest window. The consumer locks it (INSERT ...
-- ON CONFLICT DO UPDATE) to add a notification: to that window while nobody has claimed its
-- delivery yet, else to a new one.
CREATE TABLE notify_group (
    id                 bigserial PRIMARY KEY,
    receiver           text NOT NULL CHECK (receiver ~ '\S'),
    group_key          text NOT NULL CHECK (group_key ~ '\S'),
    labels             jsonb NOT NULL CHECK (jsonb_typeof(labels) = 'object'),
    windows            integer NOT NULL DEFAULT 0 CHECK (windows >= 0),
    window_delivery_id bigint,
    window_due_at      timestamptz,
    -- The route's repeat_interval_s when the window was made (0: never repeated).
    repeat_interval_s  double precision NOT NULL DEFAULT 0 CHECK (repeat_interval_s >= 0),
    created_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT notify_group_once UNIQUE (receiver, group_key),
    CONSTRAINT notify_group_window CHECK (
        (windows = 0) = (window_delivery_id IS NULL AND window_due_at IS NULL))
);

ALTER TABLE notify_delivery ADD COLUMN group_id bigint REFERENCES notify_group (id);

-- What a window's delivery carries: each event once, with its alarm (the alarms its
-- acceptance pushes).
CREATE TABLE notify_delivery_member (
    delivery_id bigint NOT NULL REFERENCES notify_delivery (id) ON DELETE CASCADE,
    event_id    uuid NOT NULL,
    alarm_id    bigint,
    PRIMARY KEY (delivery_id, event_id)
);

CREATE INDEX notify_delivery_member_alarm_idx ON notify_delivery_member (alarm_id)
    WHERE alarm_id IS NOT NULL;
-- The repeat pass: groups whose latest window may be due for a repeat.
CREATE INDEX notify_group_repeat_idx ON notify_group (window_due_at) WHERE repeat_interval_s > 0;
-- Retention: a group none of whose deliveries remain is deleted (maintenance).
CREATE INDEX notify_delivery_group_idx ON notify_delivery (group_id) WHERE group_id IS NOT NULL;
