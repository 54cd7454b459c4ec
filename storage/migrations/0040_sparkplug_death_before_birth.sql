-- The bdSeq of an NDEATH taken before the NBIRTH of its own session (docs/sparkplug.md,
-- "Several nodes: $share"): an edge node that births and loses its connection at once has its
-- Will published by the broker right after its NBIRTH, and another node of the `$share` group
-- may commit the Will first. The death of a session not born here yet is kept, and that
-- session's NBIRTH, when it comes, finds it dead: the node and its devices stay offline. NULL:
-- none. Any NBIRTH clears it. A node of the previous release leaves it as it is.
ALTER TABLE sparkplug_node ADD COLUMN dead_bdseq bigint;
