-- When the presence stored for a device was read off the broker, on the database's clock, and
-- by which node: a presence is applied only when it was received after the one stored (or the
-- same node stored both: its order is the broker's), so a node a batch behind no longer
-- overwrites another node's newer `online` with the Will `offline` it read before it
-- (docs/rules-and-alarms.md). NULL: not known (stored before this migration, a Sparkplug
-- birth or death), which any presence may follow, as before. Nullable columns without a
-- default: no rewrite of the table.
ALTER TABLE device
    ADD COLUMN presence_received_at timestamptz,
    ADD COLUMN presence_node text;
