"""Campaigns over Sparkplug devices (docs/commands.md, "Campaigns" and "Sparkplug devices"):
each target's command is its metric write, a DCMD as `POST /commands` sends it, confirmed by
the value reported back, counted by the campaign; against Eclipse Tahu's JavaScript edge node,
a real mosquitto, a real daemon and PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import pytest

from tests.support.api_client import OPERATOR, ApiClient
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.sparkplug_edge import EdgeNode, edge_node
from tests.support.waiting import wait_until

CONFIG = f"""
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["Plant1"]

[commands]
ack_window_s = 5
reaper_interval_s = 0.2

[[api.tokens]]
token = "{OPERATOR}"
role = "operator"
name = "ops"
"""

NODE_METRICS = [{"name": "Uptime", "alias": 1, "type": "Int64", "value": 7}]
DEVICE_METRICS = [
    {"name": "temp", "alias": 10, "type": "Double", "value": 20.5},
    {"name": "setpoint", "alias": 13, "type": "Float", "value": 20.0},
]
DEVICES = ("Oven", "Fridge")
IDS = [f"Plant1/Line4/{d}" for d in DEVICES]


class Site:
    def __init__(self, dsn: str, api: ApiClient, edge: EdgeNode) -> None:
        self.dsn = dsn
        self.api = api
        self.edge = edge

    async def campaign(self, **body: Any) -> tuple[int, Any]:
        reply = await self.api.call("POST", "/campaigns", token=OPERATOR, json=body)
        return reply.status, reply.body

    async def settled(self, campaign_id: int, status: str) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        async def closed() -> bool:
            reply = await self.api.call("GET", f"/campaigns/{campaign_id}", token=OPERATOR)
            assert reply.status == 200, reply.body
            seen.update(reply.body)
            return bool(reply.body["status"] == status)

        await wait_until(closed, timeout=30, message=f"the campaign {status}: {seen}")
        return seen

    async def commands(self) -> int:
        conn = await asyncpg.connect(self.dsn)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM command"))
        finally:
            await conn.close()

    def writes(self) -> dict[str, list[Any]]:
        """Each device's DCMD metrics as the edge node received them."""
        found: dict[str, list[Any]] = {}
        for event in self.edge.events:
            if event.get("event") == "dcmd":
                found.setdefault(event["device"], []).extend(event["metrics"])
        return found


@pytest.fixture
async def site(db_dsn: str, mosquitto: Mosquitto) -> AsyncIterator[Site]:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=CONFIG)
    async with (
        running_daemon(config) as daemon,
        edge_node(mosquitto.port, "Plant1", "Line4") as edge,
        aiohttp.ClientSession() as http,
    ):
        api = ApiClient(base=f"http://127.0.0.1:{daemon.http_port}", http=http)
        await edge.send("nbirth", metrics=NODE_METRICS)
        for device in DEVICES:
            await edge.send("dbirth", device=device, metrics=DEVICE_METRICS)

        async def born() -> bool:
            reply = await api.call("GET", "/devices?selector=Plant1/Line4/*", token=OPERATOR)
            return reply.status == 200 and {d["device_id"] for d in reply.body["items"]} >= set(IDS)

        await wait_until(born, timeout=30, message="both devices born and known")
        await edge.send("echo", on=True)
        yield Site(db_dsn, api, edge)


async def test_a_campaign_of_two_sparkplug_devices_by_id_writes_each_and_completes(
    site: Site,
) -> None:
    status, body = await site.campaign(
        name="setpoint", params={"value": 42.5}, targets={"devices": IDS}
    )
    assert status == 201, body
    done = await site.settled(body["campaign"]["id"], "COMPLETED")
    assert done["total"] == 2
    assert done["counts"]["ACKED"] == 2, done
    wrote = site.writes()
    for device in DEVICES:
        assert wrote.get(device) == [{"name": "setpoint", "type": "Float", "value": 42.5}], wrote


async def test_a_campaign_by_a_sparkplug_selector_writes_each_and_completes(site: Site) -> None:
    targets = await site.api.call(
        "GET", "/campaigns/targets?selector=Plant1/Line4/*", token=OPERATOR
    )
    assert targets.status == 200, targets.body
    assert targets.body["sample"] == sorted(IDS)
    # A glob crosses levels as the rules' do: the edge node is a device too (docs/commands.md).
    for selector, picked in (
        ("Plant1/*", ["Plant1/Line4", *sorted(IDS)]),
        ("Plant1/*/*", sorted(IDS)),
    ):
        found = await site.api.call(
            "GET", f"/campaigns/targets?selector={selector}", token=OPERATOR
        )
        assert found.body["sample"] == picked, found.body
    status, body = await site.campaign(
        name="setpoint", params={"value": 7.25}, targets={"selector": "Plant1/Line4/*"}
    )
    assert status == 201, body
    done = await site.settled(body["campaign"]["id"], "COMPLETED")
    assert done["counts"]["ACKED"] == 2, done
    assert {
        c["device_id"]
        for c in (
            await site.api.call("GET", f"/campaigns/{done['id']}/commands", token=OPERATOR)
        ).body["items"]
    } == set(IDS)
    wrote = site.writes()
    for device in DEVICES:
        assert wrote.get(device) == [{"name": "setpoint", "type": "Float", "value": 7.25}], wrote


async def test_params_no_sparkplug_write_can_carry_are_refused_naming_the_sparkplug_targets(
    site: Site,
) -> None:
    """A mixed campaign whose params are not a metric write (`{"value": v}`): the Sparkplug
    targets' commands could only fail, unsent, and count as failures toward the abort criteria
    of a campaign meant for the native devices (cancelling theirs). Refused, nothing created;
    and `POST /commands` refuses the same write to one Sparkplug device the same way."""
    status, body = await site.campaign(
        name="set_config",
        params={"interval_s": 60},
        targets={"devices": ["pump-1", *IDS]},
        abort={"failure_ratio": 0.5, "min_finished": 2},
    )
    assert status == 422, body
    assert body["error"] == "SPARKPLUG_WRITE_INVALID", body
    assert body["device_ids"] == IDS, body
    reply = await site.api.call(
        "POST",
        "/commands",
        token=OPERATOR,
        json={"device_id": IDS[0], "name": "setpoint", "params": {"val": 1}},
    )
    assert reply.status == 422, reply.body
    assert reply.body["error"] == "SPARKPLUG_WRITE_INVALID", reply.body
    assert reply.body["device_ids"] == IDS[:1], reply.body
    assert await site.commands() == 0


async def test_a_mixed_campaign_with_a_metric_write_sends_each_device_its_command(
    site: Site,
) -> None:
    """`{"value": v}` means the same to both: the native device gets it as its JSON downlink,
    the Sparkplug device as its DCMD write, confirmed by the echo."""
    status, body = await site.campaign(
        name="setpoint", params={"value": 3.5}, targets={"devices": ["pump-1", IDS[0]]}
    )
    assert status == 201, body
    campaign_id = body["campaign"]["id"]

    async def acked() -> bool:
        reply = await site.api.call(
            "GET", f"/campaigns/{campaign_id}/commands?status=ACKED", token=OPERATOR
        )
        return [c["device_id"] for c in reply.body["items"]] == [IDS[0]]

    await wait_until(acked, timeout=30, message="the Sparkplug target's write confirmed")
    assert site.writes() == {"Oven": [{"name": "setpoint", "type": "Float", "value": 3.5}]}
    reply = await site.api.call("POST", f"/campaigns/{campaign_id}/cancel", token=OPERATOR)
    assert reply.status == 200, reply.body


async def test_a_write_to_a_device_not_born_fails_unsent_and_counts_toward_the_abort(
    site: Site,
) -> None:
    """As with `POST /commands`, a write the birth in force cannot carry is created, then
    FAILED unsent (`SPARKPLUG_NOT_BORN`): a campaign counts it, and its abort criteria see it.
    Whichever of the two outcomes the settler counts first, the second meets them."""
    ghost = "Plant1/Line4/Ghost"
    status, body = await site.campaign(
        name="setpoint",
        params={"value": 9.5},
        targets={"devices": [IDS[0], ghost]},
        abort={"failure_ratio": 0.5, "min_finished": 2},
    )
    assert status == 201, body
    done = await site.settled(body["campaign"]["id"], "ABORTED")
    assert done["counts"]["FAILED"] == 1, done
    failed = await site.api.call(
        "GET", f"/campaigns/{done['id']}/commands?status=FAILED", token=OPERATOR
    )
    assert [(c["device_id"], c["raw_result_code"]) for c in failed.body["items"]] == [
        (ghost, "SPARKPLUG_NOT_BORN")
    ]
    assert "Ghost" not in site.writes()
