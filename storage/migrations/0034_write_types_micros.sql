-- The rows a batch writes (storage.rule_state.write_states, storage.ingest.insert_telemetry)
-- carry their times as microseconds since 1970-01-01T00:00:00Z instead of timestamptz:
-- asyncpg encodes a timestamptz from a Python datetime through several Python-level calls (a
-- time-zone conversion, a subtraction, three attribute reads), more than the rest of a
-- telemetry record, and a rule-state row has one or two times a batch (the newest sample's,
-- the clearing sample's). The queries turn them back exactly (whole seconds through
-- to_timestamp, the microseconds as an interval). Measured in docs/performance.md ("Times sent
-- as microseconds"). rule_state_write and telemetry_write stay: a node not yet upgraded still
-- sends them.
CREATE TYPE rule_state_write_us AS (
    device_id      text,
    rule_key       text,
    version        bigint,
    rule_version   text,
    firing         boolean,
    pending_count  integer,
    pending_since  bigint,
    last_ts        bigint,
    last_seq       bigint,
    fired_ts       bigint,
    fired_event_id text,
    released_ts    bigint,
    clear_ts       bigint,
    clear_event_id text,
    violating_ts   bigint
);

CREATE TYPE telemetry_write_us AS (
    event_id     text,
    device_id    text,
    ts_us        bigint,
    seq          bigint,
    metrics_json text,
    events_json  text
);
