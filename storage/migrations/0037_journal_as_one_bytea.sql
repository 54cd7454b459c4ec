-- The crash-loop breaker's journal holds its digests as one bytea, 16 bytes each end to end,
-- instead of a bytea[] of them.
--
-- The journal is rewritten before every batch (docs/architecture.md, "Poison messages") and
-- read only at start. As an array, the server cut the bytes it was sent into up to a thousand
-- 16-byte elements every batch and stored the array compressed if it could (digests do not
-- compress): about 1.15 ms of PostgreSQL a write of 1,000 digests against 0.3 as one bytea
-- stored as it comes (STORAGE EXTERNAL: out of line, no compression tried); the reading at
-- start cuts it instead (breaker.sql, recover_journal). A journal left by a node that died
-- before the upgrade keeps its digests in their order.
ALTER TABLE ingest_journal ADD COLUMN digest_bytes bytea;

UPDATE ingest_journal j
SET digest_bytes = coalesce(
    (SELECT string_agg(d, ''::bytea ORDER BY n) FROM unnest(j.digests) WITH ORDINALITY AS u(d, n)),
    ''::bytea);

ALTER TABLE ingest_journal DROP COLUMN digests;
ALTER TABLE ingest_journal RENAME COLUMN digest_bytes TO digests;
ALTER TABLE ingest_journal ALTER COLUMN digests SET NOT NULL;
ALTER TABLE ingest_journal ALTER COLUMN digests SET STORAGE EXTERNAL;
