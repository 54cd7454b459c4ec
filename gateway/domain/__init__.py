"""The pure domain: the alarm, command and campaign state machines, rules (``rules``: model,
validation, state, evaluation), quiet hours, notifications' pure part, the AI task and its
prompts, redaction, the rule replay, and the error root (``errors``).

No I/O and no clock: plain functions over immutable values. Entry points: its modules, e.g.
``gateway.domain.rules``, ``gateway.domain.alarm``, ``gateway.domain.command``. May import
``protocol`` only: never ``storage``, a database, HTTP, MQTT, logging or metrics library (an
import-linter contract), nor any other package of ``gateway``.
"""
