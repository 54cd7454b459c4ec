-- A group's repeats come back when a shelf over one of its open alarms ends
-- (docs/notifications.md, "Repeat"; ISA-18.2: an unshelved alarm returns to annunciation).
--
-- A group with nothing left to repeat used to lose its repeat interval (set to 0); it now
-- keeps it and is marked stopped, so a shelf ending later can start it again. The shelf's end
-- (lifted, or expired by a timer: decided once) records in its own transaction the group's
-- alarms it freed and when; the repeat pass (any node, the group's row locked) makes that
-- group's repeat, once, `group_interval_s` after its latest window was due at the earliest.
-- Groups stopped before this migration have lost their interval: they stay stopped until a
-- new notification arrives, as before.

ALTER TABLE notify_group
    -- The route's group_interval_s when the latest window was made.
    ADD COLUMN group_interval_s double precision NOT NULL DEFAULT 0
        CHECK (group_interval_s >= 0),
    -- Nothing was left to repeat: no repeat until a new window, or a shelf's end.
    ADD COLUMN repeat_stopped boolean NOT NULL DEFAULT false,
    -- A shelf over these open alarms of the group ended at resume_at: a repeat is owed.
    ADD COLUMN resume_at timestamptz,
    ADD COLUMN resume_alarm_ids bigint[],
    ADD CONSTRAINT notify_group_resume CHECK ((resume_at IS NULL) = (resume_alarm_ids IS NULL));

-- The repeat pass: groups owed a repeat by a shelf's end.
CREATE INDEX notify_group_resume_idx ON notify_group (resume_at) WHERE resume_at IS NOT NULL;
