"""Alarm rules: their configuration, its validation, and the pure evaluation engine.

Owns four jobs, one module each: `model` (the validated rules, device selectors, `RuleSet`),
`config` (`RuleConfig`, the `[[rules]]` tables, and `compile_rules`), `state` (`RuleState`,
device clocks, `state_keys`) and `evaluate` (`evaluate`, the hold timer's `fire_held`). This
face re-exports what the rest of the gateway uses: import from `gateway.domain.rules`, not from
its modules. Pure domain: it may import `protocol` and the rest of `gateway.domain` only.

Nothing here does I/O or reads a clock: times come from the messages (device timestamps) or
from the caller (`now`).

The state of each (device, rule) — firing or not, pending samples, the device times that
order late samples — is a `RuleState`, a row of the `rule_state` table. The ingest
transaction of a batch reads the rows its messages touch (`state_keys`) under lock, lets
`evaluate` judge the messages in order against them, writes the outcomes, then writes the
rows back (the hold timer, `fire_held`, writes pending rows under the same locks); no process
keeps any of it between batches, so every node decides alike:

    states = {key: row for key, row in locked rows of the union of state_keys(...)}
    for device_id, event_id, message in batch:  # later messages see the earlier ones' effects
        evaluation = evaluate(rules, states, device_id, event_id, message)
        ...write evaluation.outcomes, in order...
    write back the entries of `states` that changed; commit

Per (device, rule), the outcomes of successive in-order evaluations alternate Firing,
Clearing, Firing... except that an event rule fires again on every new occurrence (the
database supersedes the previous alarm). Outcomes of one message must be written in their
order: a message carrying `DOOR_OPEN` then `DOOR_CLOSE` fires an alarm and then clears it.
"""

from __future__ import annotations

from gateway.domain.rules.config import *
from gateway.domain.rules.evaluate import *
from gateway.domain.rules.model import *
from gateway.domain.rules.runs import *
from gateway.domain.rules.state import *
