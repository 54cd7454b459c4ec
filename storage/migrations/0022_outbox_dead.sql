-- An outbox event the broker can never take (larger than its maximum packet size, or a topic
-- or payload it refuses for good: gateway/support/publish_refusal.py) becomes DEAD, with the
-- reason in last_error, instead of being retried forever. DEAD is done, like PUBLISHED: it no
-- longer holds back its aggregate's later events, nor counts in the backlog; but it was never
-- published (published_at stays NULL, and nothing was pushed for it).
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_status_check;
ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_status_check
    CHECK (status IN ('PENDING', 'PUBLISHING', 'PUBLISHED', 'DEAD'));
ALTER TABLE outbox_event ADD CONSTRAINT outbox_dead_has_reason
    CHECK (status <> 'DEAD' OR last_error IS NOT NULL);

-- The open events only (the claim, the backlog): DEAD joins PUBLISHED outside them.
DROP INDEX outbox_unpublished_idx;
CREATE INDEX outbox_unpublished_idx ON outbox_event (id) WHERE status IN ('PENDING', 'PUBLISHING');
DROP INDEX outbox_aggregate_idx;
CREATE INDEX outbox_aggregate_idx ON outbox_event (aggregate_type, aggregate_id, id)
    WHERE status IN ('PENDING', 'PUBLISHING');
