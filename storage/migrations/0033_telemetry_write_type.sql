-- The telemetry rows a batch inserts (storage.ingest.insert_telemetry) travel as one array
-- of this type instead of six arrays, one per column, for the reason migration 0032 gives
-- for rule_state_write: asyncpg checks every element of an array parameter in Python (about
-- ten checks a row over six arrays, three over one array of records). Measured on 500 rows:
-- 3.2 -> 2.3 us of the gateway's CPU per row, PostgreSQL's no higher (docs/performance.md,
-- "Fewer statements and fewer array elements"). The fields are TelemetryRow's, in its order.
CREATE TYPE telemetry_write AS (
    event_id     text,
    device_id    text,
    ts           timestamptz,
    seq          bigint,
    metrics_json text,
    events_json  text
);
