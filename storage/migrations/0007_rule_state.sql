-- Rule state: one row per (device, rule) that a sample or event has touched, read and written
-- under lock in the ingest transaction of the batch that moves it, so that every node (and a
-- restarted one) decides from the same state. Times are device times (the samples' own
-- timestamps). Inactivity rules have no row: their state is device.last_seen and the alarm.

CREATE TABLE rule_state (
    device_id       text NOT NULL,
    rule_key        text NOT NULL,
    -- Fingerprint of the rule definition the row was written under; under another one the
    -- pending count is dropped and the facts kept.
    rule_version    text NOT NULL,
    firing          boolean NOT NULL DEFAULT false,
    pending_count   integer NOT NULL DEFAULT 0,
    pending_since   timestamptz,
    last_ts         timestamptz,
    last_seq        bigint,
    fired_ts        timestamptz,
    fired_event_id  text,
    released_ts     timestamptz,
    clear_ts        timestamptz,
    clear_event_id  text,
    violating_ts    timestamptz,
    -- Bumped by every write; a write names the version it read (a conditional write).
    version         bigint NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    node_id         text,
    PRIMARY KEY (device_id, rule_key),
    CONSTRAINT rule_state_pending_consistent CHECK (
        pending_count >= 0 AND (pending_count = 0) = (pending_since IS NULL)
    ),
    CONSTRAINT rule_state_firing_has_no_pending CHECK (NOT firing OR pending_count = 0),
    CONSTRAINT rule_state_fired_pair CHECK ((fired_ts IS NULL) = (fired_event_id IS NULL)),
    CONSTRAINT rule_state_clear_pair CHECK ((clear_ts IS NULL) = (clear_event_id IS NULL))
);

-- Removing a rule drops its state: by rule key.
CREATE INDEX rule_state_rule_key_idx ON rule_state (rule_key);

-- An installation upgraded from per-process state: the pairs whose active alarm has not
-- cleared were firing. An empty version drops nothing that exists (no pending counts yet).
INSERT INTO rule_state (device_id, rule_key, rule_version, firing)
SELECT device_id, rule_key, '', true
FROM alarm
WHERE active_key IS NOT NULL AND cleared_at IS NULL
ON CONFLICT DO NOTHING;
