-- Sized for a million devices x 3 rules (`gateway-sim size`, docs/performance.md "A million
-- devices"), measured on PostgreSQL 15 against a hot subset of 10,000 devices driven by the
-- gateway's own batch statements from three connections, 60 s per setting:
--
-- * rule_state_rule_key_idx goes. Its one reader, drop_removed, asks for the rows whose rule
--   key is NOT any of the running rules: a btree cannot serve that, and the plan over 3,000,000
--   rows is a sequential scan with or without it. It held 19 MB there, and every update that
--   is not HOT (14-20 % of them) inserted an entry into it.
-- * fillfactor 80 on rule_state and device: the room a row's next version needs on its own
--   page. rule_state: HOT updates 80 % -> 86 % (the rest change pending_count, a column of
--   rule_state_pending_idx's predicate), dead rows -40 %, growth under the load 22.5 -> 9.3 MB
--   a minute; device (last_seen moves at most once a second): HOT 89 % -> 100 %. The price:
--   the tables start 26 % larger (414 -> 521 MB and 80 -> 101 MB at a million devices), and
--   the inactivity sweep, a sequential scan of device, reads that much more. The setting
--   applies to pages written from now on; `VACUUM FULL` (or pg_repack) rewrites an existing
--   table with it.
DROP INDEX IF EXISTS rule_state_rule_key_idx;
ALTER TABLE rule_state SET (fillfactor = 80);
ALTER TABLE device SET (fillfactor = 80);
