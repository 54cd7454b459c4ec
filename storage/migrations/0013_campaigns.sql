-- Fleet command campaigns (behaviour §7): one request, many ordinary commands. A campaign is an
-- aggregate of its own (RUNNING, then COMPLETED, ABORTED or CANCELLED once), every change a
-- conditional write with its audit row and outbox event. Its commands carry campaign_id.

CREATE TABLE campaign (
    id               bigserial PRIMARY KEY,
    name             text NOT NULL,
    params           jsonb NOT NULL DEFAULT '{}',
    delivery         text NOT NULL DEFAULT 'realtime'
                     CONSTRAINT campaign_delivery_valid
                     CHECK (delivery IN ('realtime', 'deferrable')),
    status           text NOT NULL DEFAULT 'RUNNING'
                     CONSTRAINT campaign_status_valid
                     CHECK (status IN ('RUNNING', 'COMPLETED', 'ABORTED', 'CANCELLED')),
    -- What the caller asked for: a list of device ids, or the selector's patterns.
    target_devices   text[],
    target_selector  text[],
    -- The devices the targets resolved to when the campaign started, in command order.
    device_ids       text[] NOT NULL,
    -- Rollout: at most per_minute of its commands leave PENDING per minute, on all nodes
    -- together. A token bucket the claim statement refills and spends under FOR UPDATE.
    per_minute       integer,
    rollout_tokens   double precision,
    rollout_at       timestamptz,
    -- Abort: once min_finished commands are terminal and the FAILED + TIMEOUT share reaches
    -- failure_ratio, the campaign is ABORTED and its open commands CANCELLED.
    failure_ratio    double precision,
    min_finished     integer,
    idempotency_key  text,
    created_by       text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    -- Why it stopped, in words (the abort's counts, the canceller).
    status_reason    text,

    CONSTRAINT campaign_name_valid CHECK (btrim(name) <> '' AND char_length(name) <= 128),
    CONSTRAINT campaign_one_target_kind CHECK ((target_devices IS NULL) <> (target_selector IS NULL)),
    CONSTRAINT campaign_has_devices CHECK (cardinality(device_ids) >= 1),
    CONSTRAINT campaign_per_minute_positive CHECK (per_minute IS NULL OR per_minute >= 1),
    CONSTRAINT campaign_rollout_bucket CHECK (
        (per_minute IS NULL) = (rollout_tokens IS NULL AND rollout_at IS NULL)
        AND (rollout_at IS NULL) = (rollout_tokens IS NULL)
    ),
    CONSTRAINT campaign_abort_pair CHECK ((failure_ratio IS NULL) = (min_finished IS NULL)),
    CONSTRAINT campaign_failure_ratio_range
        CHECK (failure_ratio IS NULL OR (failure_ratio > 0 AND failure_ratio <= 1)),
    CONSTRAINT campaign_min_finished_positive CHECK (min_finished IS NULL OR min_finished >= 1),
    CONSTRAINT campaign_idempotency_key_not_blank
        CHECK (idempotency_key IS NULL OR btrim(idempotency_key) <> ''),
    CONSTRAINT campaign_finished_iff_closed
        CHECK ((status = 'RUNNING') = (finished_at IS NULL))
);

-- POST /campaigns with a key: the same key twice is one campaign.
CREATE UNIQUE INDEX campaign_idempotency_key_unique ON campaign (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX campaign_status_idx ON campaign (status, id);
-- The claim statement locks the running campaigns with a rollout limit.
CREATE INDEX campaign_rollout_idx ON campaign (id) WHERE status = 'RUNNING' AND per_minute IS NOT NULL;

CREATE TABLE campaign_audit (
    id           bigserial PRIMARY KEY,
    campaign_id  bigint NOT NULL REFERENCES campaign (id),
    actor        text NOT NULL CONSTRAINT campaign_audit_actor_not_blank CHECK (btrim(actor) <> ''),
    action       text NOT NULL,
    from_status  text
                 CONSTRAINT campaign_audit_from_status_valid
                 CHECK (from_status IN ('RUNNING', 'COMPLETED', 'ABORTED', 'CANCELLED')),
    to_status    text NOT NULL
                 CONSTRAINT campaign_audit_to_status_valid
                 CHECK (to_status IN ('RUNNING', 'COMPLETED', 'ABORTED', 'CANCELLED')),
    node_id      text NOT NULL,
    note         text,
    request_id   text,
    at           timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX campaign_audit_campaign_idx ON campaign_audit (campaign_id, id);

ALTER TABLE command
    ADD COLUMN campaign_id bigint REFERENCES campaign (id),
    -- Made by a campaign with a rollout limit: the claim takes these only through their
    -- campaign's bucket. A column of its own (not a join to campaign) so that the planner's
    -- statistics see how few rows it concerns, and the claim of everything else keeps its plan.
    ADD COLUMN paced boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT command_paced_has_campaign CHECK (NOT paced OR campaign_id IS NOT NULL);

-- Counts per status, the campaign's commands page by page, its open ones.
CREATE INDEX command_campaign_idx ON command (campaign_id, status, id)
    WHERE campaign_id IS NOT NULL;

-- A campaign command reaching a terminal status may finish its campaign (or trip its abort
-- criteria): wake the nodes' campaign settlers. Identical notifications fold per transaction.
CREATE FUNCTION campaign_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('campaign_settle', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER campaign_command_finished AFTER UPDATE OF status ON command
    FOR EACH ROW
    WHEN (NEW.campaign_id IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status
          AND NEW.status IN ('ACKED', 'FAILED', 'TIMEOUT', 'CANCELLED'))
    EXECUTE FUNCTION campaign_notify();
