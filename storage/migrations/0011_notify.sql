-- Notifications (docs/notifications.md): outbox events become deliveries, one
-- per (event, receiver), through the idempotent consumer `consumed_event`.

-- Outbox ids come from a sequence and transactions commit out of id order, so "id > the last
-- id seen" would skip an event whose transaction committed late. The consumer keeps a
-- transaction-id horizon over `outbox_event.xid` (0010) instead: every transaction older than
-- it has finished and every event it wrote was consumed.

-- One row per consumer: its horizon. Only ever moves forward. Outbox rows pruned long after
-- they were consumed do not touch it.
CREATE TABLE notify_consumer (
    consumer    text PRIMARY KEY CHECK (consumer ~ '\S'),
    horizon     xid8 NOT NULL DEFAULT '0',
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE notify_silence (
    id          bigserial PRIMARY KEY,
    -- {"rules": [...], "devices": [...], "severities": [...]}: an absent key matches everything.
    matchers    jsonb NOT NULL CHECK (jsonb_typeof(matchers) = 'object'),
    starts_at   timestamptz NOT NULL DEFAULT now(),
    ends_at     timestamptz NOT NULL,
    comment     text NOT NULL DEFAULT '',
    created_by  text NOT NULL CHECK (created_by ~ '\S'),
    created_at  timestamptz NOT NULL DEFAULT now(),
    -- Set by DELETE /silences/{id}: the silence ended early (ends_at is moved to that moment).
    expired_by  text
);

CREATE INDEX notify_silence_active_idx ON notify_silence (ends_at);

CREATE TABLE notify_delivery (
    id               bigserial PRIMARY KEY,
    event_id         uuid NOT NULL,
    outbox_id        bigint NOT NULL,
    -- The notification event (alarm.created, alarm.closed, command.failed, ...).
    event            text NOT NULL CHECK (event ~ '^[a-z]+\.[a-z_]+$'),
    receiver         text NOT NULL CHECK (receiver ~ '\S'),
    -- What is sent: the body, built once when the delivery is created (every attempt sends
    -- the same bytes but the signature's timestamp).
    body             jsonb NOT NULL CHECK (jsonb_typeof(body) = 'object'),
    alarm_id         bigint,
    device_id        text,
    rule_key         text,
    severity         text,
    status           text NOT NULL DEFAULT 'PENDING'
                     CHECK (status IN ('PENDING', 'SENDING', 'SENT', 'FAILED', 'SILENCED')),
    -- Attempts started; also the generation a finishing write is conditional on.
    attempts         integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    lease_owner      text,
    lease_until      timestamptz,
    last_error       text,
    silence_id       bigint REFERENCES notify_silence (id),
    sent_by          text,
    event_created_at timestamptz NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    CONSTRAINT notify_delivery_once UNIQUE (event_id, receiver),
    CONSTRAINT notify_delivery_sending_has_lease CHECK (
        status <> 'SENDING' OR (lease_owner IS NOT NULL AND lease_until IS NOT NULL)),
    CONSTRAINT notify_delivery_silenced_has_silence CHECK (
        (status = 'SILENCED') = (silence_id IS NOT NULL)),
    CONSTRAINT notify_delivery_final_has_time CHECK (
        (status IN ('SENT', 'FAILED', 'SILENCED')) = (finished_at IS NOT NULL)),
    CONSTRAINT notify_delivery_failed_has_error CHECK (
        status <> 'FAILED' OR last_error IS NOT NULL)
);

-- The claim: open deliveries of a receiver, due first.
CREATE INDEX notify_delivery_open_idx ON notify_delivery (receiver, next_attempt_at, id)
    WHERE status IN ('PENDING', 'SENDING');
CREATE INDEX notify_delivery_event_idx ON notify_delivery (event_id);
CREATE INDEX notify_delivery_status_idx ON notify_delivery (status, id);

-- Delivery workers LISTEN here: a new due delivery wakes them (polling remains the fallback).
CREATE FUNCTION notify_delivery_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('notify_delivery', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER notify_delivery_notify AFTER INSERT ON notify_delivery
    FOR EACH STATEMENT EXECUTE FUNCTION notify_delivery_notify();

-- The gateway's consumer starts after every transaction up to this one: events written
-- before notifications existed (0010 gave them this migration run's transaction ids or
-- older) are history, not news, and are not sent.
INSERT INTO notify_consumer (consumer, horizon)
VALUES ('notify', (pg_current_xact_id()::text::bigint + 1)::text::xid8);
