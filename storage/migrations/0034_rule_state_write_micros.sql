-- The rows a batch writes back to rule_state (storage.rule_state.write_states) carry their
-- times as microseconds since 1970-01-01T00:00:00Z instead of timestamptz: asyncpg encodes a
-- timestamptz from a Python datetime through several Python-level calls (a time-zone
-- conversion, a subtraction, three attribute reads), and a batch writes one or two times per
-- row (the newest sample's, the clearing sample's). The query turns them back exactly
-- (storage/queries/rule_state.sql, write_states). Measured in docs/performance.md ("Times
-- sent as microseconds"). rule_state_write stays: a node not yet upgraded still sends it.
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
