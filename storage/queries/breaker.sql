-- name: write_journal
-- $1 node id, $2 the digests of the batch about to be decoded and stored (committed on its
-- own, before it), 16 bytes each, end to end, stored as sent (migration 0037): one bytea costs
-- the gateway a fraction of what encoding a bytea[] of a thousand elements does (asyncpg
-- checks each element's type in Python), and the server nothing to cut.
-- Committed without waiting for the WAL flush (synchronous_commit off for this statement's
-- own transaction only): the journal must outlive the gateway process, which a commit does at
-- once, not a crash of PostgreSQL itself; waiting for the flush doubled the fsyncs per batch.
-- $3 days a suspect is remembered. Returns, in the same round trip, the deaths the fleet has
-- counted of the journaled messages (each suspect of them with its deaths): another node's
-- deaths since this node started, and a quarantined message that comes back, are known
-- before it is decoded. The suspects are few (usually none): the digests are cut only to be
-- looked up by the primary key.
WITH relaxed AS (SELECT set_config('synchronous_commit', 'off', true)),
journaled AS (
    INSERT INTO ingest_journal (node_id, digests, written_at)
    SELECT $1, $2::bytea, now()
    FROM relaxed
    ON CONFLICT (node_id) DO UPDATE
    SET digests = EXCLUDED.digests, written_at = EXCLUDED.written_at
)
SELECT s.digest, s.deaths
FROM ingest_suspect AS s
WHERE s.last_death_at >= now() - make_interval(days => $3)
  AND s.digest IN (
      SELECT substring($2::bytea FROM i FOR 16)
      FROM generate_series(1, length($2::bytea), 16) AS i
  );

-- name: clear_journal
-- $1 node id; a clean stop: nothing of this node is in flight.
DELETE FROM ingest_journal WHERE node_id = $1;

-- name: recover_journal
-- $1 node id, $2 days a suspect is remembered; at start: what the node's journal still holds
-- was in flight when it died, and each such message counts one more death. Returns every
-- suspect remembered, with its deaths in a row.
WITH died AS (
    DELETE FROM ingest_journal WHERE node_id = $1 RETURNING digests
), counted AS (
    INSERT INTO ingest_suspect AS s (digest, deaths, node_id)
    SELECT DISTINCT substring(died.digests FROM i FOR 16), 1, $1
    FROM died, generate_series(1, length(died.digests), 16) AS i
    ON CONFLICT (digest) DO UPDATE
    SET deaths = s.deaths + 1, last_death_at = now(), node_id = EXCLUDED.node_id
    RETURNING digest, deaths
), forgotten AS (
    DELETE FROM ingest_suspect WHERE last_death_at < now() - make_interval(days => $2)
)
SELECT digest, deaths FROM counted
UNION ALL
SELECT digest, deaths FROM ingest_suspect
WHERE digest NOT IN (SELECT digest FROM counted)
  AND last_death_at >= now() - make_interval(days => $2);

-- name: forget_suspects
-- $1 digests of suspects that were stored or dead-lettered (the breaker is done with them).
DELETE FROM ingest_suspect WHERE digest = ANY($1::bytea[]);

-- name: keep_quarantined
-- $1 digests of messages quarantined again (at the limit of deaths): not forgotten, or the
-- same message coming back (retained, repeated by its device, on another node) would be
-- processed, and kill, again; remembered the days a suspect is from its last arrival.
UPDATE ingest_suspect SET last_death_at = now() WHERE digest = ANY($1::bytea[]);

-- name: take_unbounded_telemetry
-- no parameters; removes and returns the telemetry stored at PostgreSQL's infinity or
-- -infinity (before such times were refused at decoding), to be kept as dead letters.
DELETE FROM telemetry WHERE ts = 'infinity' OR ts = '-infinity'
RETURNING event_id, device_id, ts = 'infinity' AS future, seq, metrics::text, events::text;
