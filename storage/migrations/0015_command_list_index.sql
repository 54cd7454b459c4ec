-- GET /commands?status= pages the fleet's commands of one status, newest first. ACKED is most of
-- the table: walking the primary key backwards finds a page of them at once. PENDING has
-- command_pending_idx (0006); CLAIMED and SENT are only the commands in flight, under
-- command_in_flight_device_idx. FAILED, TIMEOUT and CANCELLED are rare: with no index of their
-- own, a page of them walks every command ever made (the table is not pruned). This one takes
-- an entry only when a command ends so, never on the way of one that succeeds.
CREATE INDEX command_unsuccessful_idx ON command (id)
    WHERE status IN ('FAILED', 'TIMEOUT', 'CANCELLED');
