-- Downlink commands: seven states (behaviour §7), their receipt log and their audit trail.
-- The states and the transition whitelist live in gateway/domain/command.py; the CHECKs below
-- are the invariants of a single row that hold whatever path reached it. CHECK passes on NULL,
-- so every condition spells out its NULL cases.

CREATE TABLE command (
    id               bigserial PRIMARY KEY,
    device_id        text NOT NULL,
    name             text NOT NULL,
    params           jsonb NOT NULL DEFAULT '{}',
    -- realtime by default: a command nobody asked to defer is never executed hours late.
    delivery         text NOT NULL DEFAULT 'realtime'
                     CONSTRAINT command_delivery_valid
                     CHECK (delivery IN ('realtime', 'deferrable')),
    status           text NOT NULL DEFAULT 'PENDING'
                     CONSTRAINT command_status_valid
                     CHECK (status IN ('PENDING', 'CLAIMED', 'SENT', 'ACKED', 'FAILED', 'TIMEOUT',
                                       'CANCELLED')),
    idempotency_key  text,
    -- Bumped by every claim (never by a lease expiry); 0 means never claimed.
    claim_generation integer NOT NULL DEFAULT 0,
    claimed_node_id  text,
    -- The command was claimed before node ids were recorded: its claimed_node_id is NULL even
    -- while CLAIMED or SENT, and receipts for it are rejected with NODE_UNKNOWN (never guessed).
    -- New claims always record their node; nothing sets this flag but a data migration.
    legacy_claim     boolean NOT NULL DEFAULT false,
    claimed_at       timestamptz,
    lease_expire_at  timestamptz,
    sent_at          timestamptz,
    timeout_at       timestamptz,
    expire_at        timestamptz NOT NULL DEFAULT now() + interval '72 hours',
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    retry_count      integer NOT NULL DEFAULT 0,
    reclaim_count    integer NOT NULL DEFAULT 0,
    -- The standard fields of the receipt that decided the outcome; vendor codes and raw bytes
    -- stay in raw_result_code / raw_ack, never copied into the standard fields.
    result           text,
    result_code      integer,
    raw_result_code  text,
    raw_ack          text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    created_by       text,

    -- The id is put into a topic: the same grammar as protocol/ids.py.
    CONSTRAINT command_device_id_valid CHECK (device_id ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    CONSTRAINT command_name_valid CHECK (btrim(name) <> '' AND char_length(name) <= 128),
    CONSTRAINT command_idempotency_key_not_blank
        CHECK (idempotency_key IS NULL OR btrim(idempotency_key) <> ''),
    CONSTRAINT command_claim_generation_not_negative CHECK (claim_generation >= 0),
    CONSTRAINT command_retry_count_not_negative CHECK (retry_count >= 0),
    CONSTRAINT command_reclaim_count_not_negative CHECK (reclaim_count >= 0),

    -- Only a claim writes the claim fields (and a send follows a claim), and every claim bumps
    -- the generation: a command still at generation 0 carries none of them.
    CONSTRAINT command_unclaimed_has_no_claim CHECK (
        claim_generation >= 1
        OR (claimed_node_id IS NULL AND claimed_at IS NULL AND lease_expire_at IS NULL
            AND sent_at IS NULL AND timeout_at IS NULL)
    ),
    CONSTRAINT command_claimed_has_lease CHECK (
        status <> 'CLAIMED'
        OR (claim_generation >= 1 AND claimed_at IS NOT NULL AND lease_expire_at IS NOT NULL)
    ),
    CONSTRAINT command_sent_has_deadline CHECK (
        status <> 'SENT'
        OR (claim_generation >= 1 AND claimed_at IS NOT NULL
            AND sent_at IS NOT NULL AND timeout_at IS NOT NULL)
    ),
    -- A claim in force names its node, unless it predates node ids (legacy_claim above).
    CONSTRAINT command_claim_in_force_has_node CHECK (
        status NOT IN ('CLAIMED', 'SENT') OR claimed_node_id IS NOT NULL OR legacy_claim
    ),

    -- ACKED is not success of the action: ACKED means an ACKED receipt with code 0, and only
    -- ACKED holds that pair (an ACKED receipt with any other code leaves the command FAILED).
    CONSTRAINT command_acked_has_success_code CHECK (
        status <> 'ACKED'
        OR (result IS NOT DISTINCT FROM 'ACKED' AND result_code IS NOT DISTINCT FROM 0)
    ),
    CONSTRAINT command_success_code_only_when_acked CHECK (
        status = 'ACKED' OR result IS DISTINCT FROM 'ACKED' OR result_code IS DISTINCT FROM 0
    ),

    CONSTRAINT command_finished_iff_terminal CHECK (
        (status IN ('ACKED', 'FAILED', 'TIMEOUT', 'CANCELLED')) = (finished_at IS NOT NULL)
    )
);

-- POST /devices/{id}/commands with a key: the same key twice on one device is one command.
CREATE UNIQUE INDEX command_idempotency_key_unique ON command (device_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- The claim: due PENDING rows (status, next_attempt_at <= now()) in creation order.
CREATE INDEX command_due_idx ON command (status, next_attempt_at, id);
-- A device's commands (listing, unbind, the oldest open one per device).
CREATE INDEX command_device_idx ON command (device_id, id);
-- The reaper: expired leases, SENT past timeout_at, anything open past expire_at.
CREATE INDEX command_lease_idx ON command (status, lease_expire_at);
CREATE INDEX command_timeout_idx ON command (status, timeout_at);
CREATE INDEX command_expire_idx ON command (status, expire_at);

-- Every receipt, whatever its outcome (behaviour §7), as the device sent it.
CREATE TABLE command_receipt (
    id                   bigserial PRIMARY KEY,
    -- NULL when no such command exists (the device's id is kept in reported_command_id).
    command_id           bigint REFERENCES command (id),
    reported_command_id  bigint NOT NULL,
    device_id            text NOT NULL,
    claim_generation     integer,
    node_id              text,
    result               text NOT NULL
                         CONSTRAINT command_receipt_result_valid
                         CHECK (result IN ('ACKED', 'SENT', 'TIMEOUT', 'DEVICE_OFFLINE', 'FAILED')),
    result_code          integer,
    raw_result_code      text,
    raw_ack              text,
    outcome              text NOT NULL
                         CONSTRAINT command_receipt_outcome_valid
                         CHECK (outcome IN ('accepted', 'duplicated', 'rejected')),
    reason               text
                         CONSTRAINT command_receipt_reason_valid
                         CHECK (reason IN ('NODE_MISMATCH', 'NODE_UNKNOWN',
                                           'CLAIM_GENERATION_REQUIRED', 'UNKNOWN_COMMAND',
                                           'UNKNOWN_GENERATION', 'COMMAND_CLOSED',
                                           'NOT_CLAIMED')),
    -- The node that judged and applied it (not the self-reported node_id above).
    received_by          text NOT NULL,
    received_at          timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT command_receipt_rejected_has_reason
        CHECK ((outcome = 'rejected') = (reason IS NOT NULL)),
    -- Accepted and duplicated receipts answer a command that exists; an unknown one has none.
    -- A receipt without a generation is rejected before the command is looked up: either way.
    CONSTRAINT command_receipt_linked_unless_unknown CHECK (
        CASE
            WHEN reason = 'UNKNOWN_COMMAND' THEN command_id IS NULL
            WHEN reason = 'CLAIM_GENERATION_REQUIRED' THEN true
            ELSE command_id IS NOT NULL
        END
    )
);

CREATE INDEX command_receipt_command_idx ON command_receipt (command_id, id);

-- Every state change of a command, in the transaction that made it (behaviour §10).
CREATE TABLE command_audit (
    id                bigserial PRIMARY KEY,
    command_id        bigint NOT NULL REFERENCES command (id),
    actor             text NOT NULL CONSTRAINT command_audit_actor_not_blank CHECK (btrim(actor) <> ''),
    action            text NOT NULL,
    from_status       text
                      CONSTRAINT command_audit_from_status_valid
                      CHECK (from_status IN ('PENDING', 'CLAIMED', 'SENT', 'ACKED', 'FAILED',
                                             'TIMEOUT', 'CANCELLED')),
    to_status         text NOT NULL
                      CONSTRAINT command_audit_to_status_valid
                      CHECK (to_status IN ('PENDING', 'CLAIMED', 'SENT', 'ACKED', 'FAILED',
                                           'TIMEOUT', 'CANCELLED')),
    claim_generation  integer NOT NULL,
    node_id           text NOT NULL,
    note              text,
    request_id        text,
    event_id          text,
    at                timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX command_audit_command_idx ON command_audit (command_id, id);

-- Dispatchers LISTEN on this channel; polling remains the fallback. Row level, for rows that
-- are (again) PENDING: a statement-level trigger would also fire for a claim that took nothing
-- (PostgreSQL fires those for zero rows), and that notification would wake every dispatcher to
-- claim again, forever. PostgreSQL folds identical notifications within a transaction, so a
-- batch insert still sends one.
CREATE FUNCTION command_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('command_due', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER command_notify AFTER INSERT OR UPDATE OF status, next_attempt_at ON command
    FOR EACH ROW WHEN (NEW.status = 'PENDING') EXECUTE FUNCTION command_notify();
