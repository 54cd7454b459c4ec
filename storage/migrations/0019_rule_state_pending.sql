-- The hold timer (gateway.alarms.holds) looks, every pass on every node, for the rows of
-- threshold rules whose violation is pending (pending_count > 0): those whose `for_seconds`
-- may have passed with no further sample. Pending rows are a handful next to one row per
-- (device, rule); this partial index holds only them, in the timer's keyset order.
--
-- Its cost: a write that moves pending_count is no longer a HOT update (a predicate column
-- counts as indexed), so it writes new entries in the primary key and rule_key indexes too.
-- Only a row entering, counting in, or leaving a pending run pays it; the common write — a
-- sample that moves last_ts of a quiet or firing row — keeps pending_count at 0 and stays HOT.
CREATE INDEX rule_state_pending_idx ON rule_state (device_id, rule_key) WHERE pending_count > 0;
