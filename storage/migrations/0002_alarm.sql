-- Alarms: nine states (behaviour §5). Every CHECK below mirrors, by name, an invariant of
-- gateway/domain/alarm.py; keep the two in step. CHECK passes on NULL, so every condition
-- spells out its NULL cases.

CREATE TABLE alarm (
    id                  bigserial PRIMARY KEY,
    device_id           text NOT NULL,
    rule_key            text NOT NULL,
    severity            text NOT NULL
                        CONSTRAINT alarm_severity_valid
                        CHECK (severity IN ('INFO', 'WARNING', 'MAJOR', 'CRITICAL')),
    status              text NOT NULL DEFAULT 'NEW'
                        CONSTRAINT alarm_status_valid
                        CHECK (status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED',
                                          'HANDLED', 'CLOSED', 'FALSE', 'SUPERSEDED')),
    telemetry_event_id  text NOT NULL,
    -- rule_key:device_id:telemetry_event_id: one event fires one rule at most once.
    dedup_key           text NOT NULL CONSTRAINT alarm_dedup_key_unique UNIQUE,
    -- device_id:rule_key while the alarm is the active one of its device and rule; NULLs are
    -- distinct, so any number of released alarms coexist.
    active_key          text CONSTRAINT alarm_active_key_unique UNIQUE,
    triggered_at        timestamptz NOT NULL,
    pushed_at           timestamptz,
    delayed_at          timestamptz,
    woken_at            timestamptz,
    confirmed_at        timestamptz,
    confirmed_by        text,
    escalated_at        timestamptz,
    handled_at          timestamptz,
    handled_by          text,
    closed_at           timestamptz,
    closed_by           text,
    false_at            timestamptz,
    false_by            text,
    superseded_at       timestamptz,
    superseded_by       bigint CONSTRAINT alarm_superseded_by_fkey REFERENCES alarm (id),
    cleared_at          timestamptz,
    clear_event_id      text,
    last_notified_at    timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    node_id             text NOT NULL,

    -- Keys.
    CONSTRAINT alarm_dedup_key_matches
        CHECK (dedup_key = rule_key || ':' || device_id || ':' || telemetry_event_id),
    CONSTRAINT alarm_active_key_matches
        CHECK (active_key IS NULL OR active_key = device_id || ':' || rule_key),
    CONSTRAINT alarm_active_key_released_when_terminal
        CHECK (status NOT IN ('CLOSED', 'FALSE', 'SUPERSEDED') OR active_key IS NULL),

    -- Time.
    CONSTRAINT alarm_timestamps_not_before_trigger CHECK (
        (pushed_at IS NULL OR pushed_at >= triggered_at)
        AND (delayed_at IS NULL OR delayed_at >= triggered_at)
        AND (woken_at IS NULL OR woken_at >= triggered_at)
        AND (confirmed_at IS NULL OR confirmed_at >= triggered_at)
        AND (escalated_at IS NULL OR escalated_at >= triggered_at)
        AND (handled_at IS NULL OR handled_at >= triggered_at)
        AND (closed_at IS NULL OR closed_at >= triggered_at)
        AND (false_at IS NULL OR false_at >= triggered_at)
        AND (superseded_at IS NULL OR superseded_at >= triggered_at)
        AND (cleared_at IS NULL OR cleared_at >= triggered_at)
        AND (last_notified_at IS NULL OR last_notified_at >= triggered_at)
    ),
    CONSTRAINT alarm_woken_after_delayed CHECK (woken_at IS NULL OR delayed_at IS NOT NULL),
    CONSTRAINT alarm_delay_ended_when_new CHECK (
        status <> 'NEW'
        OR delayed_at IS NULL
        OR (woken_at IS NOT NULL AND woken_at >= delayed_at)
    ),
    CONSTRAINT alarm_delay_ended_before_push CHECK (
        pushed_at IS NULL
        OR delayed_at IS NULL
        OR (woken_at IS NOT NULL AND woken_at >= delayed_at)
    ),
    CONSTRAINT alarm_escalated_after_confirmed
        CHECK (escalated_at IS NULL OR confirmed_at IS NOT NULL),
    CONSTRAINT alarm_false_not_while_delayed CHECK (
        status <> 'FALSE'
        OR confirmed_at IS NOT NULL
        OR delayed_at IS NULL
        OR (woken_at IS NOT NULL AND woken_at >= delayed_at)
    ),

    -- A person's step: timestamp and actor together, the actor not blank.
    CONSTRAINT alarm_confirmed_actor_pair CHECK (
        (confirmed_at IS NULL AND confirmed_by IS NULL)
        OR (confirmed_at IS NOT NULL AND confirmed_by IS NOT NULL AND btrim(confirmed_by) <> '')
    ),
    CONSTRAINT alarm_handled_actor_pair CHECK (
        (handled_at IS NULL AND handled_by IS NULL)
        OR (handled_at IS NOT NULL AND handled_by IS NOT NULL AND btrim(handled_by) <> '')
    ),
    CONSTRAINT alarm_closed_actor_pair CHECK (
        (closed_at IS NULL AND closed_by IS NULL)
        OR (closed_at IS NOT NULL AND closed_by IS NOT NULL AND btrim(closed_by) <> '')
    ),
    CONSTRAINT alarm_false_actor_pair CHECK (
        (false_at IS NULL AND false_by IS NULL)
        OR (false_at IS NOT NULL AND false_by IS NOT NULL AND btrim(false_by) <> '')
    ),

    -- Recovery is an attribute, never a status.
    CONSTRAINT alarm_cleared_has_event CHECK (
        (cleared_at IS NULL AND clear_event_id IS NULL)
        OR (cleared_at IS NOT NULL AND clear_event_id IS NOT NULL AND btrim(clear_event_id) <> '')
    ),

    -- Supersede chains. superseded_by may be NULL for a moment inside the supersede
    -- transaction: the successor is inserted after its predecessor released the active key.
    CONSTRAINT alarm_not_superseded_by_itself
        CHECK (superseded_by IS NULL OR superseded_by <> id),

    -- Each state has the step(s) that reached it.
    CONSTRAINT alarm_pushed_has_timestamp CHECK (status <> 'PUSHED' OR pushed_at IS NOT NULL),
    CONSTRAINT alarm_delayed_has_timestamp CHECK (status <> 'DELAYED' OR delayed_at IS NOT NULL),
    CONSTRAINT alarm_confirmed_has_actor CHECK (
        status <> 'CONFIRMED' OR (confirmed_at IS NOT NULL AND confirmed_by IS NOT NULL)
    ),
    CONSTRAINT alarm_escalated_has_actor_and_timestamp CHECK (
        status <> 'ESCALATED'
        OR (confirmed_at IS NOT NULL AND confirmed_by IS NOT NULL AND escalated_at IS NOT NULL)
    ),
    CONSTRAINT alarm_handled_has_actor CHECK (
        status <> 'HANDLED' OR (handled_at IS NOT NULL AND handled_by IS NOT NULL)
    ),
    CONSTRAINT alarm_closed_has_actors CHECK (
        status <> 'CLOSED'
        OR (handled_at IS NOT NULL AND handled_by IS NOT NULL
            AND closed_at IS NOT NULL AND closed_by IS NOT NULL)
    ),
    CONSTRAINT alarm_false_has_actor CHECK (
        status <> 'FALSE' OR (false_at IS NOT NULL AND false_by IS NOT NULL)
    ),
    CONSTRAINT alarm_superseded_has_timestamp
        CHECK (status <> 'SUPERSEDED' OR superseded_at IS NOT NULL),

    -- No state holds a step that cannot lead to it.
    CONSTRAINT alarm_new_has_no_foreign_steps CHECK (
        status <> 'NEW'
        OR (pushed_at IS NULL
            AND confirmed_at IS NULL AND confirmed_by IS NULL
            AND escalated_at IS NULL
            AND handled_at IS NULL AND handled_by IS NULL
            AND closed_at IS NULL AND closed_by IS NULL
            AND false_at IS NULL AND false_by IS NULL
            AND superseded_at IS NULL AND superseded_by IS NULL)
    ),
    CONSTRAINT alarm_pushed_has_no_foreign_steps CHECK (
        status <> 'PUSHED'
        OR (confirmed_at IS NULL AND confirmed_by IS NULL
            AND escalated_at IS NULL
            AND handled_at IS NULL AND handled_by IS NULL
            AND closed_at IS NULL AND closed_by IS NULL
            AND false_at IS NULL AND false_by IS NULL
            AND superseded_at IS NULL AND superseded_by IS NULL)
    ),
    CONSTRAINT alarm_delayed_has_no_foreign_steps CHECK (
        status <> 'DELAYED'
        OR (pushed_at IS NULL
            AND confirmed_at IS NULL AND confirmed_by IS NULL
            AND escalated_at IS NULL
            AND handled_at IS NULL AND handled_by IS NULL
            AND closed_at IS NULL AND closed_by IS NULL
            AND false_at IS NULL AND false_by IS NULL
            AND superseded_at IS NULL AND superseded_by IS NULL)
    ),
    CONSTRAINT alarm_confirmed_has_no_foreign_steps CHECK (
        status <> 'CONFIRMED'
        OR (handled_at IS NULL AND handled_by IS NULL
            AND closed_at IS NULL AND closed_by IS NULL
            AND false_at IS NULL AND false_by IS NULL
            AND superseded_at IS NULL AND superseded_by IS NULL)
    ),
    CONSTRAINT alarm_escalated_has_no_foreign_steps CHECK (
        status <> 'ESCALATED'
        OR (handled_at IS NULL AND handled_by IS NULL
            AND closed_at IS NULL AND closed_by IS NULL
            AND false_at IS NULL AND false_by IS NULL
            AND superseded_at IS NULL AND superseded_by IS NULL)
    ),
    CONSTRAINT alarm_handled_has_no_foreign_steps CHECK (
        status <> 'HANDLED'
        OR (closed_at IS NULL AND closed_by IS NULL
            AND false_at IS NULL AND false_by IS NULL
            AND superseded_at IS NULL AND superseded_by IS NULL)
    ),
    CONSTRAINT alarm_closed_has_no_foreign_steps CHECK (
        status <> 'CLOSED'
        OR (false_at IS NULL AND false_by IS NULL
            AND superseded_at IS NULL AND superseded_by IS NULL)
    ),
    CONSTRAINT alarm_false_has_no_foreign_steps CHECK (
        status <> 'FALSE'
        OR (handled_at IS NULL AND handled_by IS NULL
            AND closed_at IS NULL AND closed_by IS NULL
            AND superseded_at IS NULL AND superseded_by IS NULL)
    ),
    CONSTRAINT alarm_superseded_has_no_foreign_steps CHECK (
        status <> 'SUPERSEDED'
        OR (confirmed_at IS NULL AND confirmed_by IS NULL
            AND escalated_at IS NULL
            AND handled_at IS NULL AND handled_by IS NULL
            AND closed_at IS NULL AND closed_by IS NULL
            AND false_at IS NULL AND false_by IS NULL)
    )
);

-- Open alarms, newest first, keyset-paginated by id (WHERE status IN (<open>) AND id < $cursor).
CREATE INDEX alarm_open_id_idx ON alarm (id DESC)
    WHERE status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED');
-- By status (one state's list, the schedulers' scans) and by trigger time within a status.
CREATE INDEX alarm_status_id_idx ON alarm (status, id DESC);
CREATE INDEX alarm_status_triggered_idx ON alarm (status, triggered_at DESC, id DESC);
CREATE INDEX alarm_device_idx ON alarm (device_id, id DESC);
CREATE INDEX alarm_rule_idx ON alarm (rule_key, id DESC);
-- The chain CTE walks backwards: which alarms did this one supersede?
CREATE INDEX alarm_superseded_by_idx ON alarm (superseded_by) WHERE superseded_by IS NOT NULL;
