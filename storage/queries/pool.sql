-- name: idle_in_transaction
-- $1 a duration ('30000ms'); this session is ended by the server once it has sat inside a
-- transaction that long without a statement: a node stopped in the middle of a change (its VM
-- paused, its process stopped, its link cut without a reset) held its row locks, and held back
-- every node's stream (which waits for every older transaction to end), until then.
SELECT set_config('idle_in_transaction_session_timeout', $1, false);

-- name: lock_wait
-- $1 a duration ('5000ms'); how long the statements after it in this transaction wait for a
-- lock: a person's change of a row another transaction holds gives up then (55P03).
SELECT set_config('lock_timeout', $1, true);

-- name: session_probe
-- $1 channel: a notification on it, for the connection that LISTENs there (storage.pool's
-- keeps_session: does a connection keep its server session, or is a pooler in transaction
-- mode between us and PostgreSQL?).
SELECT pg_notify($1, '');

-- name: alive
-- no parameters; whether the server answers on this connection: the daemon's start, before its
-- pool (which server a multi-host DSN's connection reaches), and a LISTEN connection, which
-- idles, so that a host gone silent under it (power, a partition: nothing reset) is noticed.
SELECT 1;
