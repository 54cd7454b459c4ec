-- command_hearing: up to when each node has stored what it received (the receipts of the
-- $share group's commands it was handed), written by its reaper's every pass. A node whose
-- database went away for a moment, or whose ingest writer lags, may hold a device's receipt
-- unstored; another node's reaper judges a missing receipt only for commands sent an ack
-- window before every live node's heard_through (gateway/commands/reaper.py). A node that
-- has not passed for COMMAND_HEARING_LIVE_S (stopped, or cut from the database that long) no
-- longer counts; its row is left behind, overwritten when it passes again.
CREATE TABLE command_hearing (
    node_id       text PRIMARY KEY,
    -- The database's time of the node's pass, less how long ago the oldest message it held
    -- unstored was received.
    heard_through timestamptz NOT NULL,
    passed_at     timestamptz NOT NULL DEFAULT now()
);
