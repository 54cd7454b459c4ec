"""How litestar resolves the routes' dependencies: one after the other, inline. Dependencies that
depend on nothing are resolved together in an anyio task group (a task each, every request);
the services are chained behind ``call`` so that no route pays for that (gateway.api.app)."""

from __future__ import annotations

from typing import Any

import aiohttp
import asyncpg
import pytest
from litestar._kwargs import kwargs_model

from gateway.config import TokenConfig
from tests.support.api_client import ADMIN, OPERATOR, VIEWER
from tests.support.api_server import serve_api

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="console"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]


async def test_no_request_spawns_tasks_to_resolve_its_dependencies(
    db_dsn: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups: list[int] = []
    original = kwargs_model.create_task_group

    def counted() -> Any:
        groups.append(1)
        return original()

    monkeypatch.setattr(kwargs_model, "create_task_group", counted)
    calls = [
        ("GET", "/alarms", VIEWER, None),
        ("GET", "/devices", VIEWER, None),
        ("GET", "/commands", VIEWER, None),
        ("GET", "/campaigns", VIEWER, None),
        ("GET", "/silences", VIEWER, None),
        ("GET", "/dead-letters", ADMIN, None),
        ("POST", "/devices/dev-1/commands", OPERATOR, {"name": "reboot"}),
        ("POST", "/alarms/1/confirm", OPERATOR, {}),  # 404: the route ran all the same
    ]
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        for method, path, token, body in calls:
            headers = {"Authorization": f"Bearer {token}"}
            async with http.request(
                method, f"{served.base}{path}", json=body, headers=headers
            ) as reply:
                assert reply.status in (200, 201, 404), (path, reply.status, await reply.text())
    assert groups == []
