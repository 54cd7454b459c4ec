-- Audit of every alarm state change, the transactional outbox, idempotent consumers.

CREATE TABLE alarm_audit (
    id           bigserial PRIMARY KEY,
    alarm_id     bigint NOT NULL REFERENCES alarm (id),
    actor        text NOT NULL CHECK (actor <> ''),
    action       text NOT NULL,
    from_status  text,
    to_status    text NOT NULL,
    note         text,
    request_id   text,
    event_id     text,
    node_id      text NOT NULL,
    at           timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX alarm_audit_alarm_idx ON alarm_audit (alarm_id, id);

CREATE TABLE outbox_event (
    id              bigserial PRIMARY KEY,
    event_id        uuid NOT NULL UNIQUE,
    aggregate_type  text NOT NULL,
    aggregate_id    text NOT NULL,
    event_type      text NOT NULL,
    schema_version  integer NOT NULL DEFAULT 1,
    payload         jsonb NOT NULL,
    status          text NOT NULL DEFAULT 'PENDING'
                    CHECK (status IN ('PENDING', 'PUBLISHING', 'PUBLISHED')),
    retry_count     integer NOT NULL DEFAULT 0,
    next_retry_at   timestamptz NOT NULL DEFAULT now(),
    lease_until     timestamptz,
    lease_owner     text,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    CONSTRAINT outbox_published_has_time CHECK ((status = 'PUBLISHED') = (published_at IS NOT NULL)),
    CONSTRAINT outbox_publishing_has_lease CHECK (
        status <> 'PUBLISHING' OR (lease_until IS NOT NULL AND lease_owner IS NOT NULL))
);

CREATE INDEX outbox_unpublished_idx ON outbox_event (id) WHERE status <> 'PUBLISHED';
CREATE INDEX outbox_aggregate_idx ON outbox_event (aggregate_type, aggregate_id, id)
    WHERE status <> 'PUBLISHED';

CREATE TABLE consumed_event (
    consumer     text NOT NULL,
    event_id     uuid NOT NULL,
    consumed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Publishers LISTEN on this channel; polling remains the fallback. One notification per
-- statement (PostgreSQL folds duplicates within a transaction).
CREATE FUNCTION outbox_event_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_event', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_event_notify AFTER INSERT ON outbox_event
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_event_notify();
