"""Alarms (docs/rules-and-alarms.md): the rule engine applied inside the ingest transaction
(``engine``), the alarm service people's actions go through (``service``), the hold timer
(``holds``), time-driven transitions (``timers``: quiet hours, escalation, reminders), inactivity
alarms (``inactivity``), rules that cannot fire (``rule_watch``) and delivery (``delivery``).

Entry points: ``AlarmEngine``, ``AlarmService``, ``AlarmTimers``, ``HoldTimer``,
``InactivityMonitor``, ``RuleWatch``, ``AlarmMetrics``. May import ``config``, ``support``,
``domain``, ``storage`` and ``protocol``; nothing above it.
"""
