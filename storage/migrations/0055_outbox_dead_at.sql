-- When an outbox event became DEAD (docs/behaviour.md §6): retention prunes DEAD events
-- `[retention] outbox_dead_days` after it (docs/operations.md, "Retention and disk"). They
-- were never pruned: a fleet with a recurring poison event (a command's params over the
-- broker's limit, every day) grew the table for ever. An event that died before this
-- migration, or on a node of the previous release during a rolling upgrade, has none: it is
-- dated by `next_retry_at`, when it was last due (it died at its next claim).
ALTER TABLE outbox_event ADD COLUMN dead_at timestamptz;
