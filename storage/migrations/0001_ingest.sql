-- Devices, telemetry (exactly once per event id) and dead letters.

CREATE TABLE device (
    device_id    text PRIMARY KEY,
    first_seen   timestamptz NOT NULL,
    last_seen    timestamptz NOT NULL,
    presence     text NOT NULL DEFAULT 'unknown'
                 CHECK (presence IN ('unknown', 'online', 'offline')),
    presence_at  timestamptz,
    bound        boolean NOT NULL DEFAULT true,
    CHECK (last_seen >= first_seen)
);

CREATE TABLE telemetry (
    event_id     text PRIMARY KEY CHECK (event_id ~ '^[0-9a-f]{64}$'),
    device_id    text NOT NULL,
    ts           timestamptz NOT NULL,
    seq          bigint,
    metrics      jsonb,
    events       jsonb,
    received_at  timestamptz NOT NULL DEFAULT now(),
    node_id      text NOT NULL
);

CREATE INDEX telemetry_device_ts_idx ON telemetry (device_id, ts DESC);

CREATE TABLE dead_letter (
    id             bigserial PRIMARY KEY,
    topic          text NOT NULL,
    payload        bytea NOT NULL,
    reason         text NOT NULL,
    detail         text NOT NULL,
    received_at    timestamptz NOT NULL DEFAULT now(),
    node_id        text NOT NULL,
    replay_count   integer NOT NULL DEFAULT 0,
    replayed_at    timestamptz,
    replay_outcome text
);

CREATE INDEX dead_letter_reason_idx ON dead_letter (reason, id);
