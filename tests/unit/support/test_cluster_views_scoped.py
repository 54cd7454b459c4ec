"""Every test's query on pg_stat_activity or pg_locks keeps to its own database.

Each test has a database of its own, on one cluster shared by the xdist workers (and by any
other run on the machine); those two views show the whole cluster. Unscoped, a test counts,
waits for or terminates another test's sessions: same node names (application_name
'gateway:<node>'), same advisory keys (per database), same statements, and relation oids
repeated in every database cloned from one template. CI failed so on
test_ops_audit_frozen_maintenance (another test's daemon held the maintenance lock).

A query is scoped when it names this database (``current_database()``, or a database given as
a parameter) or one backend (``pid = $n``). Tests on a PostgreSQL of their own are exempt.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]
VIEW = re.compile(r"\b(?:FROM|JOIN)\s+pg_(?:stat_activity|locks)\b", re.IGNORECASE)
SCOPED = re.compile(r"current_database\(\)|\bpid\s*=\s*\$\d|\bdatname\s*=\s*\$\d", re.IGNORECASE)
# Tests whose queries run on a cluster of their own (Patroni pair, private servers).
OWN_CLUSTER = {"test_ha_audit_read_only_connection.py"}
SKIPPED_DIRS = {"node_modules", ".pyvenv", "__pycache__"}


def _sources() -> list[Path]:
    return sorted(
        p
        for p in TESTS.rglob("*.py")
        if not SKIPPED_DIRS.intersection(p.relative_to(TESTS).parts) and p.name not in OWN_CLUSTER
    )


def unscoped(source: str) -> list[tuple[int, str]]:
    """The string literals of ``source`` that read a cluster-wide view unscoped."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if VIEW.search(text) and not SCOPED.search(text):
            found.append((node.lineno, " ".join(text.split())))
    return found


def test_the_check_tells_a_scoped_query_from_an_unscoped_one() -> None:
    source = (
        "A = \"SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'\"\n"
        'B = ("SELECT count(*) FROM pg_locks WHERE NOT granted"\n'
        '     " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")\n'
        'C = "SELECT query FROM pg_stat_activity WHERE pid = $1"\n'
        'D = "SELECT pid FROM pg_stat_activity WHERE datname = $1"\n'
        'E = "until pg_stat_activity shows it waiting"\n'
    )
    assert [line for line, _ in unscoped(source)] == [1]


def test_no_test_reads_pg_stat_activity_or_pg_locks_beyond_its_own_database() -> None:
    found = [
        f"{path.relative_to(TESTS)}:{line}: {text}"
        for path in _sources()
        for line, text in unscoped(path.read_text())
    ]
    assert not found, "unscoped (add datname = current_database()):\n" + "\n".join(found)
