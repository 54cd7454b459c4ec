"""Guard: the product sends no SQL written inline in Python (house rule: every statement is a
named block of storage/queries/*.sql, loaded by storage/sql.py).

An AST scan of gateway/ and storage/: a call of an asyncpg method (``fetch``, ``fetchval``,
``execute``, ...) whose statement is a string written in the code (a literal, an f-string, a
concatenation of them, or a name the module binds to one) is refused, and so is any other
string in that code that reads as a statement (``SELECT ... FROM``, ``INSERT INTO``, ...),
docstrings and comments aside. The one exception is named below with its reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[3]
PRODUCT: Final = ("gateway", "storage")
# asyncpg's statement-taking methods (Connection, Pool, PreparedStatement's source).
STATEMENT_METHODS: Final = frozenset(
    {
        "execute",
        "executemany",
        "fetch",
        "fetchval",
        "fetchrow",
        "prepare",
        "cursor",
        "copy_from_query",
    }
)
# A string that reads as a statement: its first word a statement's, then what must follow it.
STATEMENT_TEXT: Final = re.compile(
    r"^\s*(SELECT\s+\S|INSERT\s+INTO\s|UPDATE\s+\w+\s+SET\s|DELETE\s+FROM\s|WITH\s+\w+\s+AS\s*\(|"
    r"SET\s+(LOCAL\s+)?\w+\s*(=|TO)\s|RESET\s+\w|LISTEN\s|NOTIFY\s|LOCK\s+TABLE\s|"
    r"CREATE\s|DROP\s|ALTER\s|TRUNCATE\s|VACUUM\b|ANALYZE\b)"
)  # upper case, as the house writes SQL: a log line's "select a node" is no statement
# A psql script, not a statement sent by asyncpg: it runs through psql before any pool exists
# and needs psql's \gexec (CREATE DATABASE has no IF NOT EXISTS), which no named block (each
# one prepared against the schema by tests/integration/storage/test_storage.py) can hold.
ALLOWED: Final = {("gateway/embedded/postgres.py", "_CREATE_DATABASE_PSQL")}


def _is_written_string(node: ast.expr, bound: dict[str, ast.expr]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return _is_written_string(node.left, bound) or _is_written_string(node.right, bound)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        # "...".format(...), "...".join(...) on a written string
        return node.func.attr in {"format", "join"} and _is_written_string(node.func.value, bound)
    if isinstance(node, ast.Name) and node.id in bound:
        value = bound.pop(node.id)  # once: a name bound to itself would loop
        try:
            return _is_written_string(value, bound)
        finally:
            bound[node.id] = value
    return False


def _bindings(tree: ast.Module) -> dict[str, ast.expr]:
    """Names bound once, anywhere in the module, to an expression (the last binding wins)."""
    bound: dict[str, ast.expr] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound[target.id] = node.value
        elif (
            isinstance(node, ast.AnnAssign)
            and node.value is not None
            and isinstance(node.target, ast.Name)
        ):
            bound[node.target.id] = node.value
    return bound


def _docstrings(tree: ast.Module) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _allowed_strings(tree: ast.Module, path: str) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if any((path, name) in ALLOWED for name in names) and node.value is not None:
                ids.update(id(n) for n in ast.walk(node.value))
    return ids


def inline_sql(root: Path = ROOT) -> list[str]:
    found: list[str] = []
    for package in PRODUCT:
        for file in sorted((root / package).rglob("*.py")):
            path = file.relative_to(root).as_posix()
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=path)
            bound = _bindings(tree)
            docstrings = _docstrings(tree)
            allowed = _allowed_strings(tree, path)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in STATEMENT_METHODS
                ):
                    statement = node.args[0] if node.args else None
                    for kw in node.keywords:
                        if kw.arg in {"query", "command"}:
                            statement = kw.value
                    if statement is not None and _is_written_string(statement, dict(bound)):
                        found.append(f"{path}:{node.lineno}: {ast.unparse(node)[:100]}")
                elif (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and id(node) not in docstrings
                    and id(node) not in allowed
                    and STATEMENT_TEXT.match(node.value)
                ):
                    found.append(f"{path}:{node.lineno}: {node.value[:100]!r}")
    # One finding a line (a literal passed to a call is both a call's and a string's).
    return sorted({f.split(": ", 1)[0]: f for f in reversed(found)}.values())


def test_the_product_sends_no_statement_written_inline() -> None:
    assert inline_sql() == []


def test_the_scan_sees_a_statement_written_inline(tmp_path: Path) -> None:
    # The scan itself, on a made-up package: each form it must see, and what it must not flag.
    (tmp_path / "gateway").mkdir()
    (tmp_path / "storage").mkdir()
    (tmp_path / "gateway" / "x.py").write_text(
        '"""SELECT a docstring FROM here."""\n'
        "Q = 'SELECT 1'\n"
        "async def f(conn, pool, t):\n"
        '    await conn.fetchval("SELECT now()")\n'
        '    await conn.execute(f"SET x = {t}")\n'
        "    await pool.fetch(Q)\n"
        "    await conn.fetchrow(query='select' + ' 2')\n"
        "    await conn.fetch(NAMED, 1)\n"
        "    log.info('select a node', x=1)\n",
        encoding="utf-8",
    )
    (tmp_path / "storage" / "y.py").write_text(
        "_SQL = (\n    'UPDATE t SET a = 1 '\n    'WHERE b'\n)\n", encoding="utf-8"
    )
    found = inline_sql(tmp_path)
    lines = [f.split(": ", 1)[0] for f in found]
    assert lines == [
        "gateway/x.py:2",
        "gateway/x.py:4",
        "gateway/x.py:5",
        "gateway/x.py:6",
        "gateway/x.py:7",
        "storage/y.py:2",
    ], found
