-- name: install_probes
-- The benchmark's probes (sim/probes.py), in its own throwaway database only: statement-level
-- triggers that notify, at commit, what each statement stored. Payloads: "<seq> <key> <count>".
CREATE SEQUENCE bench_probe_seq;

CREATE FUNCTION bench_telemetry_probe() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT node_id, count(*) AS n FROM new_rows GROUP BY node_id LOOP
        PERFORM pg_notify('bench_stored', nextval('bench_probe_seq') || ' ' || r.node_id
                                          || ' ' || r.n);
    END LOOP;
    -- The latency phase's publish stamps, up to 400 per notification (8,000 bytes at most).
    FOR r IN
        SELECT string_agg(sent, ',') AS stamps
        FROM (SELECT metrics->>'sent_us' AS sent, (row_number() OVER ()) / 400 AS part
              FROM new_rows WHERE metrics ? 'sent_us') AS stamped
        GROUP BY part
    LOOP
        PERFORM pg_notify('bench_stamps', r.stamps);
    END LOOP;
    RETURN NULL;
END $$;
CREATE TRIGGER bench_telemetry_probe AFTER INSERT ON telemetry
REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION bench_telemetry_probe();

CREATE FUNCTION bench_alarm_probe() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT node_id, count(*) AS n FROM new_rows GROUP BY node_id LOOP
        PERFORM pg_notify('bench_alarms', nextval('bench_probe_seq') || ' ' || r.node_id
                                          || ' ' || r.n);
    END LOOP;
    RETURN NULL;
END $$;
CREATE TRIGGER bench_alarm_probe AFTER INSERT ON alarm
REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION bench_alarm_probe();

CREATE FUNCTION bench_command_probe() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT split_part(n.device_id, '-', 1) AS grp, count(*) AS n
        FROM new_rows n JOIN old_rows o USING (id)
        WHERE n.status IN ('ACKED', 'FAILED', 'TIMEOUT', 'CANCELLED')
          AND o.status NOT IN ('ACKED', 'FAILED', 'TIMEOUT', 'CANCELLED')
        GROUP BY 1
    LOOP
        PERFORM pg_notify('bench_finished', nextval('bench_probe_seq') || ' ' || r.grp
                                            || ' ' || r.n);
    END LOOP;
    RETURN NULL;
END $$;
CREATE TRIGGER bench_command_probe AFTER UPDATE ON command
REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION bench_command_probe();

-- name: drop_probes
-- Remove the probes (no parameters).
DROP TRIGGER bench_telemetry_probe ON telemetry;
DROP TRIGGER bench_alarm_probe ON alarm;
DROP TRIGGER bench_command_probe ON command;
DROP FUNCTION bench_telemetry_probe();
DROP FUNCTION bench_alarm_probe();
DROP FUNCTION bench_command_probe();
DROP SEQUENCE bench_probe_seq;

-- name: storm_alarms
-- $1 node id; alarms that node raised and distinct devices among them.
SELECT count(*) AS alarms, count(DISTINCT device_id) AS devices FROM alarm WHERE node_id = $1;

-- name: phase_alarms
-- $1 device id LIKE pattern; a phase's alarms, those cleared, and how many of its devices had
-- their telemetry stored by more than one node.
SELECT (SELECT count(*) FROM alarm WHERE device_id LIKE $1) AS alarms,
       (SELECT count(*) FROM alarm WHERE device_id LIKE $1 AND cleared_at IS NOT NULL)
           AS cleared,
       (SELECT count(*) FROM (SELECT device_id FROM telemetry WHERE device_id LIKE $1
                              GROUP BY device_id HAVING count(DISTINCT node_id) > 1) AS shared)
           AS devices_on_several_nodes;

-- name: command_timings
-- $1 device id LIKE pattern; per command: status, creation and finish (database clock).
SELECT status, created_at, finished_at FROM command WHERE device_id LIKE $1 ORDER BY id;

-- name: filled_tables
-- Between phases, the tables worth a VACUUM (ANALYZE): those the earlier phases filled. Not
-- the empty ones: statistics saying "empty" make PostgreSQL plan its foreign-key checks as
-- sequential scans, which a storm then pays once per row (measured: 5 s became 15 s).
SELECT relname FROM pg_stat_user_tables WHERE n_live_tup >= 1000 ORDER BY relname;

-- name: checkpoint
-- And the dirty pages written out now, not during the next measurement (no parameters;
-- superuser only).
CHECKPOINT;

-- name: campaign_check
-- $1 campaign id; per command of it: its status and, per generation, how many ACKED audit rows
-- and accepted ACKED receipts it has (every command ACKED exactly once per generation: 1, 1).
SELECT c.id, c.status, c.claim_generation, c.created_at, c.finished_at,
       (SELECT count(*) FROM command_audit a
        WHERE a.command_id = c.id AND a.to_status = 'ACKED') AS acked_audits,
       (SELECT count(*) FROM command_receipt r
        WHERE r.command_id = c.id AND r.outcome = 'accepted' AND r.result = 'ACKED'
          AND r.claim_generation = c.claim_generation) AS acked_receipts
FROM command c WHERE c.campaign_id = $1 ORDER BY c.id;

-- name: prefill_telemetry
-- $1 how many rows, $2 the newest row's time, $3 the seconds they span before it: telemetry
-- shaped as the gateway's rows (event ids of 64 hex characters of a hash, so in no order;
-- 1,000 devices), for scripts/hot-path insert --prefill. The caller keeps the span inside one
-- day, so that the rows share the partition of the batches measured after them.
INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, node_id)
SELECT encode(sha256(('prefill-' || g)::bytea), 'hex'), 'prefill-' || (g % 1000),
       $2::timestamptz - make_interval(secs => $3::float8 * g / $1), g,
       jsonb_build_object('temp', 20.5), 'prefill'
FROM generate_series(1, $1::bigint) AS g;

-- name: telemetry_key_by_event_id
-- Telemetry keyed as before migration 0036, (event_id, ts): scripts/hot-path insert
-- --event-id-key, to measure what the key by time changed (no parameters).
ALTER TABLE telemetry DROP CONSTRAINT telemetry_pkey,
    ADD CONSTRAINT telemetry_pkey PRIMARY KEY (event_id, ts);

-- name: wal_written
-- The server's WAL so far (no parameters): the bytes up to the current position (a
-- cluster-wide counter that moves whoever writes) and the full-page images from the
-- cumulative statistics (a backend's own reach them at its next flush).
SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint AS bytes, wal_fpi AS fpi FROM pg_stat_wal;
