-- Why the rule raised the alarm (the reason of its alarm.created event), kept with the alarm
-- for its life. The AI worker read it from that outbox event, which retention prunes
-- (outbox_days, 7 by default, once published): a summary task still due after that (a model
-- server down for a week, a long Retry-After, a summary asked for later) told the model
-- "reason": null. Alarms created before this migration have none (NULL): their reason is read
-- from their event while it is kept. Nullable and without a default, so no row is rewritten.
ALTER TABLE alarm ADD COLUMN reason text;
