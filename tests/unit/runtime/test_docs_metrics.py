"""docs/operations.md, "Health and metrics", lists every metric `/metrics` exports, with its labels.

The list is what an operator builds dashboards and alerts from: a metric missing there is one
nobody knows to watch, and a name there that the registry does not have is an alert that never
fires. The registry is every feature's MetricSet on one daemon's Metrics (what a running
daemon's `/metrics` answers, once each loop has registered its set).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

import gateway
from gateway.support.metrics import Metrics, MetricSet

DOC = Path(__file__).resolve().parents[3] / "docs" / "operations.md"
# The standard process and GC collectors: the doc names a few and ends the list with "…".
STANDARD = re.compile(r"^(process|python)_")
# A metric as the doc names it: `gateway_x_total{label,label}`.
NAMED = re.compile(r"`((?:gateway|process|python)_[a-z0-9_]+)(\{[a-z_,]+\})?`")


def _metric_sets() -> set[type[MetricSet]]:
    for module in pkgutil.walk_packages(gateway.__path__, "gateway."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    found: set[type[MetricSet]] = set()
    todo = [MetricSet]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return found


def _registry() -> CollectorRegistry:
    registry = Metrics().registry
    for metric_set in _metric_sets():
        metric_set.of(registry)
    return registry


def _exported() -> dict[str, tuple[str, ...]]:
    """Every family's name as a query writes it (`_total` for a counter, `_info` for an info),
    with its label names (a labelled metric has no sample before its first use: its label
    names are the collector's)."""
    registry = _registry()
    families: dict[str, tuple[str, ...]] = {}
    for collector in list(registry._collector_to_names):  # no public listing
        label_names = tuple(getattr(collector, "_labelnames", ()))
        for metric in collector.collect():
            name = metric.name + {"counter": "_total", "info": "_info"}.get(metric.type, "")
            labels = set(label_names)
            for sample in metric.samples:
                labels |= set(sample.labels) - {"le"}
            families[name] = tuple(sorted(labels))
    return families


def _documented() -> dict[str, tuple[str, ...] | None]:
    text = DOC.read_text()
    section = text[text.index("**`GET /metrics`**") : text.index("## What to watch")]
    found: dict[str, tuple[str, ...] | None] = {}
    for name, labels in NAMED.findall(section):
        found[name] = tuple(sorted(labels.strip("{}").split(","))) if labels else None
    return found


def test_every_exported_metric_is_listed_in_operations_md() -> None:
    documented = _documented()
    missing = sorted(
        name for name in _exported() if name not in documented and not STANDARD.match(name)
    )
    assert not missing, f"docs/operations.md, Health and metrics, does not list {missing}"


def test_every_listed_metric_is_exported_with_the_labels_given() -> None:
    exported = _exported()
    unknown = sorted(name for name in _documented() if name not in exported)
    assert not unknown, f"docs/operations.md lists metrics /metrics does not export: {unknown}"
    wrong = {
        name: (labels, exported[name])
        for name, labels in _documented().items()
        if not STANDARD.match(name) and (labels or ()) != exported[name]
    }
    assert not wrong, f"docs/operations.md's labels (doc, code) differ: {wrong}"
