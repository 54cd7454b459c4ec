-- Discarding a dead letter (DELETE /dead-letters/{id}, admins): the letter is deleted, and
-- what it was (topic, reason, size, SHA-256 of the whole payload) stays in dead_letter_audit
-- with who discarded it, in the same transaction. A letter discarded twice is answered from
-- here (409 with who did it); an id never written is a 404.

CREATE TABLE dead_letter_audit (
    id             bigserial PRIMARY KEY,
    dead_letter_id bigint NOT NULL,
    action         text NOT NULL CONSTRAINT dead_letter_audit_action_valid
                   CHECK (action IN ('discard')),
    actor          text NOT NULL
                   CONSTRAINT dead_letter_audit_actor_not_blank CHECK (btrim(actor) <> ''),
    topic          text NOT NULL,
    reason         text NOT NULL,
    payload_size   bigint NOT NULL,
    payload_sha256 text NOT NULL,
    replay_count   integer NOT NULL,
    replay_outcome text,
    node_id        text NOT NULL,
    request_id     text,
    at             timestamptz NOT NULL DEFAULT now()
);

-- One discard per letter: a second one is refused by the database too.
CREATE UNIQUE INDEX dead_letter_audit_discard_once ON dead_letter_audit (dead_letter_id)
    WHERE action = 'discard';
