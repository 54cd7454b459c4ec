-- AI summaries of alarms (behaviour §8): one row per attempt; a retry is a new PENDING row with
-- attempt + 1. The CHECKs below mirror, by name, gateway/domain/ai_task.py (Summary, Succeeded,
-- Failed); keep the two in step. CHECK passes on NULL, so every condition spells out its NULL
-- cases. "Not blank" is ~ '\S' on both sides (Python: not text.strip()).

CREATE TABLE ai_task (
    id                     bigserial PRIMARY KEY,
    alarm_id               bigint NOT NULL CONSTRAINT ai_task_alarm_id_fkey REFERENCES alarm (id),
    attempt                integer NOT NULL
                           CONSTRAINT ai_task_attempt_positive CHECK (attempt >= 1),
    status                 text NOT NULL DEFAULT 'PENDING'
                           CONSTRAINT ai_task_status_valid
                           CHECK (status IN ('PENDING', 'PROCESSING', 'SUCCEEDED', 'FAILED')),
    model_name             text NOT NULL
                           CONSTRAINT ai_task_model_name_not_blank CHECK (model_name ~ '\S'),
    prompt_version         text NOT NULL
                           CONSTRAINT ai_task_prompt_version_not_blank
                           CHECK (prompt_version ~ '\S'),
    -- Built and stored by the claim, so a task whose worker died still shows what was asked.
    request_payload        jsonb
                           CONSTRAINT ai_task_request_payload_valid
                           CHECK (request_payload IS NULL
                                  OR (jsonb_typeof(request_payload) = 'object'
                                      AND request_payload <> '{}'::jsonb)),
    -- The model's answer as received, whether or not it parsed.
    raw_response           text,
    summary                text,
    possible_cause         text,
    inspection_suggestion  text,
    risk_level             text
                           CONSTRAINT ai_task_risk_level_valid
                           CHECK (risk_level IN ('LOW', 'MEDIUM', 'HIGH', 'CRITICAL')),
    -- NaN sorts above every number in PostgreSQL, so BETWEEN refuses it (and the infinities).
    confidence             double precision
                           CONSTRAINT ai_task_confidence_in_range
                           CHECK (confidence IS NULL OR confidence BETWEEN 0 AND 1),
    error_code             text
                           CONSTRAINT ai_task_error_code_valid
                           CHECK (error_code IS NULL OR error_code ~ '^[A-Z][A-Z0-9_]*$'),
    error_message          text
                           CONSTRAINT ai_task_error_message_not_blank
                           CHECK (error_message IS NULL OR error_message ~ '\S'),
    claim_token            uuid,
    claimed_by             text,
    created_at             timestamptz NOT NULL DEFAULT now(),
    next_attempt_at        timestamptz NOT NULL DEFAULT now(),
    started_at             timestamptz,
    finished_at            timestamptz,

    -- One row per attempt; also the index for "the latest attempt of an alarm" (a btree is
    -- read backwards as cheaply as forwards, so no separate (alarm_id, attempt DESC) index).
    CONSTRAINT ai_task_alarm_attempt_unique UNIQUE (alarm_id, attempt),

    CONSTRAINT ai_task_result_text_valid CHECK (
        (summary IS NULL OR (summary ~ '\S' AND char_length(summary) <= 2000))
        AND (possible_cause IS NULL
             OR (possible_cause ~ '\S' AND char_length(possible_cause) <= 2000))
        AND (inspection_suggestion IS NULL
             OR (inspection_suggestion ~ '\S' AND char_length(inspection_suggestion) <= 2000))
    ),
    CONSTRAINT ai_task_output_invalid_keeps_raw
        CHECK (error_code IS DISTINCT FROM 'LLM_OUTPUT_INVALID' OR raw_response IS NOT NULL),
    -- A claim names its token and its worker together.
    CONSTRAINT ai_task_claim_pair CHECK (
        (claim_token IS NULL AND claimed_by IS NULL)
        OR (claim_token IS NOT NULL AND claimed_by IS NOT NULL AND claimed_by ~ '\S')
    ),
    CONSTRAINT ai_task_finished_after_started
        CHECK (finished_at IS NULL OR started_at IS NULL OR finished_at >= started_at),

    -- Each state has what reached it and nothing of a later one.
    CONSTRAINT ai_task_pending_is_unclaimed CHECK (
        status <> 'PENDING'
        OR (claim_token IS NULL AND claimed_by IS NULL AND started_at IS NULL
            AND request_payload IS NULL)
    ),
    CONSTRAINT ai_task_open_has_no_outcome CHECK (
        status NOT IN ('PENDING', 'PROCESSING')
        OR (finished_at IS NULL AND raw_response IS NULL
            AND summary IS NULL AND possible_cause IS NULL AND inspection_suggestion IS NULL
            AND risk_level IS NULL AND confidence IS NULL
            AND error_code IS NULL AND error_message IS NULL)
    ),
    CONSTRAINT ai_task_processing_has_claim CHECK (
        status <> 'PROCESSING'
        OR (claim_token IS NOT NULL AND claimed_by IS NOT NULL AND started_at IS NOT NULL
            AND request_payload IS NOT NULL)
    ),
    CONSTRAINT ai_task_succeeded_has_result CHECK (
        status <> 'SUCCEEDED'
        OR (summary IS NOT NULL AND possible_cause IS NOT NULL
            AND inspection_suggestion IS NOT NULL AND risk_level IS NOT NULL
            AND confidence IS NOT NULL AND request_payload IS NOT NULL
            AND raw_response IS NOT NULL AND raw_response ~ '\S'
            AND started_at IS NOT NULL AND finished_at IS NOT NULL)
    ),
    CONSTRAINT ai_task_succeeded_has_no_error
        CHECK (status <> 'SUCCEEDED' OR (error_code IS NULL AND error_message IS NULL)),
    CONSTRAINT ai_task_failed_has_error CHECK (
        status <> 'FAILED'
        OR (error_code IS NOT NULL AND error_message IS NOT NULL
            AND request_payload IS NOT NULL AND finished_at IS NOT NULL)
    ),
    CONSTRAINT ai_task_failed_has_no_result CHECK (
        status <> 'FAILED'
        OR (summary IS NULL AND possible_cause IS NULL AND inspection_suggestion IS NULL
            AND risk_level IS NULL AND confidence IS NULL)
    )
);

-- The claim: due PENDING rows (status, next_attempt_at <= now()) in creation order.
CREATE INDEX ai_task_due_idx ON ai_task (status, next_attempt_at, id);
-- The sweeper: PROCESSING rows started before the timeout (worker lost).
CREATE INDEX ai_task_started_idx ON ai_task (status, started_at);
