"""The field simulation in CI: a few seeds of ``gateway-sim field`` (docs/field-simulation.md).

Three real ``gateway run`` processes in one ``$share`` group, a mosquitto with persistence,
PostgreSQL and a webhook receiver, driven by a seeded plan of device streams (clocks ahead,
behind and reset, `seq` resets, store-and-forward bursts, duplicates, reordering, devices that
report by exception or go silent) and faults (SIGKILL of a node, broker restart, database
connections cut, reloads adding an inactivity rule and taking quiet hours away, a broker
outage with commands pending); then checked against the reference model (`gateway rules
replay`). A failing seed prints the command that replays it. Long runs are by hand.
"""

from __future__ import annotations

import pytest

from sim.field import render, run_field

# Fixed seeds: a failure here replays with the command the message prints.
SEEDS = (1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
async def test_a_seed_of_the_field_simulation_agrees_with_the_reference_model(
    pg_server_dsn: str, seed: int
) -> None:
    result = await run_field(seed, minutes=0.75, nodes=3, devices=20, server_dsn=pg_server_dsn)
    assert result.alarms_checked > 0
    assert result.messages > 0
    assert result.ok, render(result)
