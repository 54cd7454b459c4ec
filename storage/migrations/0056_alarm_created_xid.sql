-- The transaction that created the alarm (docs/api.md, "The alarm desk": a bulk action over a
-- group as it was read). Alarm ids come from a sequence and the nodes' ingest transactions
-- commit out of id order: an alarm with an id below a group's newest_id may commit after
-- GET /alarms/groups read the group, and nobody saw it. The group answers the snapshot it was
-- read in (as_of); a bulk action given it acts only on the alarms that snapshot saw. Alarms
-- created before this migration have none (NULL): they were committed long before any read
-- a bulk action is sent with. The default is set apart from the column, so no row is
-- rewritten.
ALTER TABLE alarm ADD COLUMN created_xid xid8;
ALTER TABLE alarm ALTER COLUMN created_xid SET DEFAULT pg_current_xact_id();
