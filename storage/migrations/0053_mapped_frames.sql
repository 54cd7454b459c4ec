-- The last radio frame read from each device of a mapping with `frame_paths` (the
-- `chirpstack-v4` profile's DevAddr, FCnt, FPort and FRMPayload), as a SHA-256 in hex, and
-- when (the database's clock): the same frame read again within a window is a retransmission
-- (the radio's, or a gateway's copy past ChirpStack's deduplication window, published under
-- another deduplicationId, time and rxInfo), not a reading of its own (docs/devices.md). Kept
-- on the device's mapping record, locked by the batch that reads the device's next frame:
-- nodes of a shared group decide one after another. NULL: no frame read yet. Nullable columns
-- without a default: no rewrite of the table.
ALTER TABLE device_mapping
    ADD COLUMN frame text,
    ADD COLUMN frame_at timestamptz;
