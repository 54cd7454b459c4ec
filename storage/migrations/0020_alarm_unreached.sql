-- When an alarm still NEW after [alarms] unreached_after_s was found to have reached nobody
-- (docs/behaviour.md §5). Set once, by a conditional write: only one node logs and counts it.

ALTER TABLE alarm ADD COLUMN unreached_at timestamptz;

-- What the timers look for on every pass: NEW alarms not yet found unreached.
CREATE INDEX alarm_unreached_due_idx ON alarm (id) WHERE status = 'NEW' AND unreached_at IS NULL;
