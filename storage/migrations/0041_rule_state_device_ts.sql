-- The newest sample's own device time, beside the time it was judged at (last_ts), where the
-- two differ (docs/rules-and-alarms.md, "Device clocks"): a sample dated past the bounds is
-- judged at its receipt, and one a stepped-back or corrected clock sent is judged at the
-- newest time already judged. NULL: the same as last_ts (every sample judged at its own time,
-- and every row written before this migration). With it a sample is weighed against what the
-- newest one said of itself as well as where it was placed: a lower seq whose own time is
-- within reorder_window_s before the newest's is late even when its receipt is later (a clock
-- stuck at 1970, or hours ahead, reordered between nodes), and a sample of a corrected clock
-- dated before a receipt the newest was judged at is newer, not late.
--
-- The rows a batch writes carry it as one more field, so they go as a type of their own:
-- rule_state_write_us stays for a node of the previous release (a rolling upgrade), which
-- writes last_ts and leaves this column as it was; a row so written holds, until a node of
-- this release writes it again, the own time of an older sample than its last_ts (the next
-- sample of that device may be weighed against it: one ordering, on a device whose clock was
-- adjusted, while both releases run). The moved rows of write_states carry it as a column of
-- lines, mostly empty.
ALTER TABLE rule_state ADD COLUMN last_device_ts timestamptz;

CREATE TYPE rule_state_write_us2 AS (
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
    violating_ts   bigint,
    last_device_ts bigint
);
