-- A command leaving CLAIMED or SENT (ACKED, FAILED, TIMEOUT, CANCELLED; back to PENDING is
-- already notified) frees one of its device's in-flight slots, so the device's next PENDING
-- command may now be claimable: wake the dispatchers. Before this, they found it only at their
-- next poll, which held a device with queued commands to one command per poll interval.
-- Identical notifications fold within a transaction: a batch of receipts sends one.
CREATE TRIGGER command_slot_freed AFTER UPDATE OF status ON command
    FOR EACH ROW
    WHEN (OLD.status IN ('CLAIMED', 'SENT') AND NEW.status NOT IN ('CLAIMED', 'SENT', 'PENDING'))
    EXECUTE FUNCTION command_notify();

-- The claim looks at PENDING rows, oldest first, skipping devices with an older PENDING
-- command or a full in-flight slot. Without these, it walked every command ever made (the
-- finished ones stay) and, per candidate, every CLAIMED/SENT row: 600 ms per claim with 3,000
-- queued and 100 in flight. Partial indexes stay as small as the open work.
CREATE INDEX command_pending_idx ON command (id) WHERE status = 'PENDING';
CREATE INDEX command_pending_device_idx ON command (device_id, id) WHERE status = 'PENDING';
CREATE INDEX command_in_flight_device_idx ON command (device_id)
    WHERE status IN ('CLAIMED', 'SENT');
