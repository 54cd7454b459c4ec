-- A receipt whose resultCode is not one of the standard codes (0-4) is refused and kept as
-- sent, with its own reason; the command's result_code only ever holds a standard code.
ALTER TABLE command_receipt
    DROP CONSTRAINT command_receipt_reason_valid,
    ADD CONSTRAINT command_receipt_reason_valid
        CHECK (reason IN ('NODE_MISMATCH', 'NODE_UNKNOWN', 'CLAIM_GENERATION_REQUIRED',
                          'UNKNOWN_COMMAND', 'UNKNOWN_GENERATION', 'COMMAND_CLOSED',
                          'NOT_CLAIMED', 'INVALID_RESULT_CODE'));
