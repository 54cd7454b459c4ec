-- Per-device clock figures (docs/rules-and-alarms.md "Device clocks", GET /devices/{id}):
-- how often a device's samples were judged at another time than their own, or ordered by
-- their seq against it, per reason, and the last time each happened. Written by the ingest
-- batch that judged the sample, in its transaction, only when an adjustment happened; the
-- count is added to in SQL, so every node's batches add up.

CREATE TABLE device_clock (
    device_id         text NOT NULL,
    reason            text NOT NULL,
    count             bigint NOT NULL CHECK (count > 0),
    -- The last adjustment for this reason: the database time of the batch that judged it,
    -- the device time the sample was sent with, and the time it was judged at.
    last_received_at  timestamptz NOT NULL,
    last_device_ts    timestamptz NOT NULL,
    last_judged_ts    timestamptz NOT NULL,
    PRIMARY KEY (device_id, reason)
);
