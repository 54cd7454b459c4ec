"""The notification examples of the README and docs/notifications.md are valid configuration."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.config import load_config
from gateway.domain.notify_match import Facts
from gateway.domain.notify_policy import inhibitor

ROOT = Path(__file__).resolve().parents[3]
_TOML_BLOCK = re.compile(r"```toml\n(.*?)```", re.DOTALL)
ENV = {"GATEWAY_WEBHOOK_SECRET": "a-secret-of-the-test", "GATEWAY_SMTP_PASSWORD": "pw"}


def _blocks(name: str) -> list[str]:
    return [b for b in _TOML_BLOCK.findall((ROOT / name).read_text()) if "notify." in b]


_NAME = re.compile(r'^name = "([^"]+)"', re.MULTILINE)


def _with_receivers(block: str, blocks: list[str]) -> str:
    """The example, plus the page's other examples' receivers it names but does not define."""
    defined = set(_NAME.findall(block))
    extra = [b for b in blocks if b is not block and not defined & set(_NAME.findall(b))]
    return block + "".join(b for b in extra if "[[notify.routes]]" not in b)


@pytest.mark.parametrize("name", ["README.md", "docs/notifications.md"])
def test_each_example_is_a_valid_config(name: str, tmp_path: Path) -> None:
    blocks = _blocks(name)
    assert blocks, f"{name} has no notification example"
    for block in blocks:
        path = tmp_path / "example.toml"
        path.write_text(_with_receivers(block, blocks))
        config = load_config(path, environ=ENV)
        assert config.notify_rules().receivers


def test_the_docs_example_routes_behave_as_described(tmp_path: Path) -> None:
    blocks = _blocks("docs/notifications.md")
    [routes] = [b for b in blocks if "continue = true" in b]
    path = tmp_path / "routes.toml"
    path.write_text(_with_receivers(routes, blocks))
    rules = load_config(path, environ=ENV).notify_rules()

    critical_lab = Facts(event="alarm.created", device_id="lab-1", severity="CRITICAL")
    assert rules.route(critical_lab) == ["pager"]
    assert rules.route(Facts(event="alarm.created", device_id="plant-1", severity="MAJOR")) == [
        "ops-mail"
    ]
    assert rules.route(Facts(event="command.failed", device_id="lab-2")) == []
    assert rules.route(Facts(event="alarm.cleared", device_id="plant-1", severity="MAJOR")) == []


def test_the_docs_inhibition_example_mutes_the_sites_devices_silent_alarms(tmp_path: Path) -> None:
    blocks = _blocks("docs/notifications.md")
    [example] = [b for b in blocks if "[[notify.inhibit]]" in b]
    path = tmp_path / "inhibit.toml"
    path.write_text(_with_receivers(example, blocks))
    rules = load_config(path, environ=ENV).notify_rules()
    gateway = Facts(event="alarm.open", device_id="gw-north", rule_key="gateway-silent",
                    severity="MAJOR", alarm_id=1)  # fmt: skip

    def silent(alarm_id: int, device: str) -> Facts:
        return Facts(event="alarm.created", device_id=device, rule_key="device-silent",
                     severity="MAJOR", alarm_id=alarm_id)  # fmt: skip

    assert inhibitor(rules.inhibit, silent(2, "north-1"), [gateway], rules.sites) is not None
    assert inhibitor(rules.inhibit, silent(3, "south-1"), [gateway], rules.sites) is None


def test_the_docs_grouping_example_groups_by_site_and_rule(tmp_path: Path) -> None:
    blocks = _blocks("docs/notifications.md")
    [example] = [b for b in blocks if "group_by" in b]
    path = tmp_path / "group.toml"
    path.write_text(_with_receivers(example, blocks))
    rules = load_config(path, environ=ENV).notify_rules()
    silent = Facts(event="alarm.created", device_id="north-3", rule_key="device-silent")
    [(receiver, route)] = rules.targets(silent)
    assert receiver == "ops-mail"
    assert route.grouping is not None
    assert (route.grouping.wait_s, route.grouping.interval_s) == (30, 300)
    key, labels = route.grouping.group(route.index, silent, rules.sites)
    assert key == "routes[0]{site=north,rule=device-silent}"
    assert labels == {"site": "north", "rule": "device-silent"}
