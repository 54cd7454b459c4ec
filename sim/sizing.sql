-- Statements of `gateway-sim size` (sim/sizing.py). The load itself runs the gateway's own
-- statements (storage/queries/ingest.sql and rule_state.sql), read from there.

-- name: set_fillfactor
-- Formatted with the percentage (an integer the script checks): storage parameters take no
-- bind parameters. Set before the fill, so that the fill leaves that much room per page.
ALTER TABLE device SET (fillfactor = {fillfactor});
ALTER TABLE rule_state SET (fillfactor = {fillfactor});

-- name: fill_devices
-- $1 how many devices, $2 their id prefix; every one heard from a minute ago, as after a
-- steady state: first_seen a day before, presence online (a retained status seen once).
INSERT INTO device (device_id, first_seen, last_seen, presence, presence_at)
SELECT $2 || lpad(n::text, 7, '0'), now() - interval '1 day', now() - interval '1 minute',
       'online', now() - interval '1 day'
FROM generate_series(0, $1 - 1) AS n;

-- name: fill_states
-- $1 how many devices, $2 their id prefix, $3 rule keys; one row per (device, rule), written
-- by a batch before: a version, the last sample's time and sequence number, a node; every
-- tenth device once fired and cleared (both event ids, 64 hex digits as the gateway's).
-- Inserted in primary key order, as a fleet that reported in order would have filled it.
INSERT INTO rule_state (device_id, rule_key, rule_version, last_ts, last_seq, fired_ts,
                        fired_event_id, clear_ts, clear_event_id, version, updated_at, node_id)
SELECT $2 || lpad(n::text, 7, '0'), r, left(md5(r), 16), now() - interval '1 minute', 1000,
       CASE WHEN n % 10 = 0 THEN now() - interval '2 hours' END,
       CASE WHEN n % 10 = 0 THEN md5(n::text || r) || md5(r || n::text) END,
       CASE WHEN n % 10 = 0 THEN now() - interval '1 hour' END,
       CASE WHEN n % 10 = 0 THEN md5(r || n::text) || md5(n::text || r) END,
       1000, now() - interval '1 minute', 'node-a'
FROM generate_series(0, $1 - 1) AS n, unnest($3::text[]) AS r
ORDER BY 1, 2;

-- name: table_figures
-- $1 table names; per table: heap and index bytes, rows, the update counters (HOT among
-- them), dead rows, and the autovacuum/autoanalyze counters and last times.
SELECT t.relname AS name,
       pg_relation_size(t.relid) AS heap_bytes,
       pg_indexes_size(t.relid) AS index_bytes,
       t.n_live_tup AS live_rows,
       t.n_tup_upd AS updates,
       t.n_tup_hot_upd AS hot_updates,
       t.n_dead_tup AS dead_rows,
       t.autovacuum_count AS autovacuums,
       t.last_autovacuum AS last_autovacuum,
       t.autoanalyze_count AS autoanalyzes,
       c.reloptions AS options
FROM pg_stat_user_tables t JOIN pg_class c ON c.oid = t.relid
WHERE t.relname = ANY ($1::text[])
ORDER BY t.relname;

-- name: index_sizes
-- $1 table names; each of their indexes and its bytes.
SELECT indexrelname AS name, relname AS table_name, pg_relation_size(indexrelid) AS bytes
FROM pg_stat_user_indexes
WHERE relname = ANY ($1::text[])
ORDER BY relname, indexrelname;

-- name: lock_waiters
-- $1 the load's backends; how many of them wait for a lock (a row another batch holds) now.
SELECT count(*) FROM pg_stat_activity
WHERE pid = ANY ($1::int[]) AND wait_event_type = 'Lock';
