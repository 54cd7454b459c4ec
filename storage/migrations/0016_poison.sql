-- The crash-loop breaker (docs/architecture.md, "Poison messages"). A message that makes the
-- process die (a crash in a C extension, memory, a hang the service manager kills) was never
-- acknowledged, so the broker delivers it again after every restart: without a memory outside
-- the process it would stop ingest for the whole fleet, forever.
--
-- ingest_journal: per node, the digests of the batch being stored, written before the batch's
-- transaction begins; emptied at a clean stop. What it holds at the next start was in flight
-- when the node died.
CREATE TABLE ingest_journal (
    node_id     text PRIMARY KEY,
    digests     bytea[] NOT NULL,
    written_at  timestamptz NOT NULL DEFAULT now()
);

-- ingest_suspect: messages in flight at a death, by digest (of topic and payload), with the
-- number of deaths in a row. Processed alone while suspected, forgotten once stored; a
-- message at the limit of deaths becomes a dead letter (QUARANTINED) unprocessed.
CREATE TABLE ingest_suspect (
    digest         bytea PRIMARY KEY,
    deaths         integer NOT NULL CHECK (deaths > 0),
    first_death_at timestamptz NOT NULL DEFAULT now(),
    last_death_at  timestamptz NOT NULL DEFAULT now(),
    node_id        text NOT NULL
);

-- Rule state written from a sample dated at the very ends of datetime's range holds
-- PostgreSQL's infinity, which asyncpg reads back as a naive datetime: every later sample of
-- that (device, rule) failed its comparison and stopped the daemon. Such times are refused
-- at decoding now; a state that holds one takes the time it was written at instead.
UPDATE rule_state
SET pending_since = CASE WHEN NOT isfinite(pending_since) THEN updated_at ELSE pending_since END,
    last_ts = CASE WHEN NOT isfinite(last_ts) THEN updated_at ELSE last_ts END,
    fired_ts = CASE WHEN NOT isfinite(fired_ts) THEN updated_at ELSE fired_ts END,
    released_ts = CASE WHEN NOT isfinite(released_ts) THEN updated_at ELSE released_ts END,
    clear_ts = CASE WHEN NOT isfinite(clear_ts) THEN updated_at ELSE clear_ts END,
    violating_ts = CASE WHEN NOT isfinite(violating_ts) THEN updated_at ELSE violating_ts END
WHERE NOT isfinite(pending_since) OR NOT isfinite(last_ts) OR NOT isfinite(fired_ts)
   OR NOT isfinite(released_ts) OR NOT isfinite(clear_ts) OR NOT isfinite(violating_ts);
