-- The operator console's needs: why an alarm fired, who stated they acted, a live stream of
-- outbox events exact across transactions that commit out of id order, and stream tickets.

-- Why the alarm fired, stored when it is created (null for alarms created before this).
ALTER TABLE alarm
    ADD COLUMN trigger jsonb,
    ADD COLUMN rule_description text;

-- The API records the token's name as the actor; an actor the caller wrote in the body is
-- kept apart, untrusted.
ALTER TABLE alarm_audit ADD COLUMN stated_actor text;

-- The transaction that wrote the event. An event is streamed only once every transaction
-- older than the oldest one still running has ended (xid < pg_snapshot_xmin), so the set of
-- events below that line is final, and (xid, id) is an order no late commit can break.
ALTER TABLE outbox_event ADD COLUMN xid xid8 NOT NULL DEFAULT pg_current_xact_id();
CREATE INDEX outbox_event_xid_idx ON outbox_event (xid, id);

-- Short-lived single-use tickets for the live stream (EventSource cannot send headers):
-- stored as a SHA-256 digest, so that any node accepts a ticket any node issued.
CREATE TABLE stream_ticket (
    digest      bytea PRIMARY KEY CHECK (octet_length(digest) = 32),
    token_name  text NOT NULL,
    role        text NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    used_at     timestamptz
);

CREATE INDEX stream_ticket_expires_idx ON stream_ticket (expires_at);
