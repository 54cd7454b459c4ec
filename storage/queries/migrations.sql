-- name: create_migration_table
-- no parameters; the bookkeeping table itself (the only IF NOT EXISTS we allow).
CREATE TABLE IF NOT EXISTS schema_migration (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: lock
-- $1 advisory lock key; serialises migrations of all nodes starting at once.
SELECT pg_advisory_lock($1);

-- name: unlock
-- $1 advisory lock key.
SELECT pg_advisory_unlock($1);

-- name: applied
-- no parameters; every applied migration.
SELECT version, name, checksum FROM schema_migration ORDER BY version;

-- name: record
-- $1 version, $2 name, $3 checksum.
INSERT INTO schema_migration (version, name, checksum) VALUES ($1, $2, $3);

-- name: notify_migrated
-- $1 channel, $2 the version just recorded (text); sent at the commit of its migration, to every
-- running node (gateway.runtime.schema_watch): an older release among them stops.
SELECT pg_notify($1, $2);

-- name: migration_table_exists
-- no parameters; false on a database never migrated.
SELECT to_regclass('schema_migration') IS NOT NULL;

-- name: schema_version
-- no parameters; the newest applied migration (needs the bookkeeping table).
SELECT coalesce(max(version), 0) FROM schema_migration;
