-- The alarm system's own figures (GET /alarm-stats, docs/alarm-figures.md) read a time window of
-- alarms by their trigger time, the open alarms by age, and people's actions by their time.
-- None of the existing indexes leads with those columns.

-- Alarms raised in a window: counts per 10 minutes, per rule and device, chattering pairs.
-- rule_key and device_id ride along, so the counts are index-only scans on a vacuumed table.
CREATE INDEX alarm_triggered_idx ON alarm (triggered_at) INCLUDE (rule_key, device_id);

-- Stale alarms: open ones by age (only open alarms have an entry, as alarm_open_id_idx).
CREATE INDEX alarm_open_triggered_idx ON alarm (triggered_at)
    WHERE status IN ('NEW', 'PUSHED', 'DELAYED', 'CONFIRMED', 'ESCALATED');

-- People's actions in a window (per operator, time to acknowledge): the system's rows (create,
-- push, delay, ...), most of the table, take no entry.
CREATE INDEX alarm_audit_person_at_idx ON alarm_audit (at) INCLUDE (alarm_id, actor, action)
    WHERE action IN ('confirm', 'handle', 'close', 'false');
