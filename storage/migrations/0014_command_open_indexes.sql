-- The command row changes status four times in its life (PENDING, CLAIMED, SENT, a terminal
-- one). Status is indexed, so no change is a HOT update: each inserts an entry into every index
-- whose predicate the new row satisfies. The indexes the reaper's scans use were over every
-- command ever made, keyed by status first; each scan reads one open status. As partial indexes
-- over that status alone they take no entry for a finished command (most of the table), and a
-- command's life writes 9 fewer index entries. command_due_idx had no reader: the claim walks
-- command_pending_idx (0006).

DROP INDEX command_due_idx;

DROP INDEX command_lease_idx;
CREATE INDEX command_lease_idx ON command (lease_expire_at) WHERE status = 'CLAIMED';

DROP INDEX command_timeout_idx;
CREATE INDEX command_timeout_idx ON command (timeout_at) WHERE status = 'SENT';

DROP INDEX command_expire_idx;
CREATE INDEX command_expire_idx ON command (expire_at)
    WHERE status IN ('PENDING', 'CLAIMED', 'SENT');
