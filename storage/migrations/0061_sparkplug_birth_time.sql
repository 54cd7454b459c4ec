-- The payload timestamp (epoch ms, the edge node's clock) of the NBIRTH in force (null: none,
-- or one without a timestamp). A data message, DBIRTH or DDEATH published before it (its
-- payload timestamp older) and committed within the reorder window of that birth (another node
-- of a `$share` group held it) is of the session before: its aliases may be another metric's
-- now, and its seq is of another stream. It used to be read with the new births' aliases (the
-- seq starts again at 0 with each NBIRTH, so it looked in order); it is a dead letter
-- SPARKPLUG_OLD_SESSION (docs/sparkplug.md). A node of the previous release leaves it as it is.
ALTER TABLE sparkplug_node ADD COLUMN birth_ts bigint;
