-- The seq of each device's latest DBIRTH or DDEATH taken while a seq before it was missing
-- (docs/sparkplug.md, "Several nodes: `$share`"), as {"device": seq}: a late message (one that
-- fills a missing seq, committed by another node of a `$share` group) older than it in seq
-- order changes neither the device's presence nor its births. A DDEATH committed before its
-- own DBIRTH used to leave the device online (for good with an edge node that does not answer
-- rebirth requests), and a DDEATH committed after the DBIRTH that follows it, offline. Empty
-- while no seq is missing (no message can be late then). A node of the previous release leaves
-- it as it is.
ALTER TABLE sparkplug_node ADD COLUMN device_marks jsonb NOT NULL DEFAULT '{}'::jsonb;
