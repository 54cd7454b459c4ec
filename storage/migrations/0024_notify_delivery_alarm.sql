-- An alarm's notifications, found by the alarm: the timers release the ones quiet hours held
-- when the alarm is woken, and push a woken alarm whose notification a receiver accepted while
-- it was held (a node still without the window sent it). Both ran a scan of every delivery per
-- woken alarm; a window ending over thousands of alarms wakes them all in one pass.

CREATE INDEX notify_delivery_alarm_idx ON notify_delivery (alarm_id) WHERE alarm_id IS NOT NULL;
