-- Sparkplug B host application (issue 25 §1, docs/sparkplug.md): what each edge node's births
-- said and where its stream stands, so that every node of a `$share` group judges the next
-- message as one would. A batch locks the rows of the edge nodes it carries (FOR UPDATE, in
-- key order) and writes them back in the transaction that stores the batch.

CREATE TABLE sparkplug_node (
    group_id text NOT NULL,
    edge_node_id text NOT NULL,
    -- Born: an NBIRTH was taken and no NDEATH (with its bdSeq) came since.
    born boolean NOT NULL DEFAULT false,
    -- The bdSeq of the last NBIRTH: an NDEATH with another one is an older session's Will.
    bdseq bigint,
    -- The highest seq seen since the birth (0..255, wrapping), and the seqs skipped on the way
    -- ({"seq": epoch seconds when first missed}), filled by late messages within
    -- [sparkplug] reorder_window_s.
    seq integer,
    missing jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- Trusted: born, and nothing missing or unknown since. An untrusted node's data is stored
    -- but not judged by the rules until its next NBIRTH.
    trusted boolean NOT NULL DEFAULT false,
    -- Alias -> [device or '', metric name, datatype], from NBIRTH and DBIRTHs.
    aliases jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- Metric name -> datatype, per device ('' for the node): {"": {...}, "dev": {...}}.
    metrics jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- Devices born since the node's birth.
    devices text[] NOT NULL DEFAULT '{}',
    -- Ids of the last messages applied (hex prefixes): a redelivery is recognised and skipped.
    recent text[] NOT NULL DEFAULT '{}',
    -- A rebirth is wanted (why, since when), and when it was last asked for (NCMD).
    rebirth_reason text,
    rebirth_wanted_at timestamptz,
    rebirth_sent_at timestamptz,
    rebirth_requests integer NOT NULL DEFAULT 0,
    born_at timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, edge_node_id),
    CONSTRAINT sparkplug_node_seq_range CHECK (seq IS NULL OR seq BETWEEN 0 AND 255)
);

-- The rebirth loop's work: edge nodes with a request to send.
CREATE INDEX sparkplug_node_rebirth_wanted ON sparkplug_node (rebirth_wanted_at)
    WHERE rebirth_wanted_at IS NOT NULL;

-- Commands to Sparkplug devices and edge nodes (docs/commands.md, "Sparkplug devices"): their
-- ids are two or three levels of the native grammar, `{group}/{node}[/{device}]`.
ALTER TABLE command DROP CONSTRAINT command_device_id_valid;
ALTER TABLE command ADD CONSTRAINT command_device_id_valid
    CHECK (device_id ~ '^[A-Za-z0-9_.:-]{1,64}(/[A-Za-z0-9_.:-]{1,64}){0,2}$');
