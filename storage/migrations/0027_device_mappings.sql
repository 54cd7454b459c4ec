-- Devices read through an [[ingest.mappings]] entry (issue 25 §2, docs/devices.md): the
-- mapping's name and the topic wildcards the device was last seen with. A command to such a
-- device is published on the mapping's command_topic, rendered from these wildcards (the
-- vendor's own id, which a normalised device id may no longer spell).

CREATE TABLE device_mapping (
    device_id text PRIMARY KEY,
    mapping text NOT NULL,
    captures jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
