-- The rows a batch writes (storage.rule_state.write_states, storage.ingest.insert_telemetry)
-- carry their times as microseconds since 1970-01-01T00:00:00Z instead of timestamptz:
-- asyncpg encodes a timestamptz from a Python datetime through several Python-level calls (a
-- time-zone conversion, a subtraction, three attribute reads), more than the rest of a
-- telemetry record, and a rule-state row has one or two times a batch (the newest sample's,
-- the clearing sample's). The queries turn them back with from_micros, below. Measured in
-- docs/performance.md ("Times as microseconds, names checked once"). rule_state_write and
-- telemetry_write stay: a node not yet upgraded still sends them.

-- Microseconds since 1970-01-01T00:00:00Z as a timestamptz, exactly: the whole seconds through
-- to_timestamp (exact for any second a float8 holds), then the microseconds as an interval. A
-- float8 of microseconds (to_timestamp(us / 1e6)) is off by one from the 2110s on. One SQL
-- expression, declared STABLE as timestamptz + interval is: the planner inlines it into each
-- query (no call per row). NULL gives NULL.
CREATE FUNCTION from_micros(us bigint) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
RETURN to_timestamp(us / 1000000) + (us % 1000000) * interval '1 microsecond';

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
