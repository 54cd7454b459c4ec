-- Each device's latest life taken while a seq before it was missing (docs/sparkplug.md,
-- "Several nodes: `$share`"), as {"device": [birth seq, death seq]}: the seq of its `DBIRTH` in
-- force (null: born before the first seq missing) and of the `DDEATH` that ended that birth
-- (null: alive). A late data message of a device dead now (one that fills a missing seq,
-- committed by another node of a `$share` group after the `DDEATH`) published within that
-- life, no seq between the birth and it still missing, is stored, read with that birth's
-- aliases: it used to be a dead letter SPARKPLUG_NOT_BORN and a rebirth request. Empty while
-- no seq is missing, as device_marks (migration 0059). A node of the previous release leaves
-- it as it is.
ALTER TABLE sparkplug_node ADD COLUMN device_lives jsonb NOT NULL DEFAULT '{}'::jsonb;
