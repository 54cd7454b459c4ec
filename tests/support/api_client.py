"""An HTTP client for the operator API tests: bearer tokens, one reply shape."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import aiohttp

VIEWER = "viewer-token-0123456789abcdef"
OPERATOR = "operator-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"


@dataclass
class Reply:
    status: int
    body: Any
    headers: Any


@dataclass
class ApiClient:
    base: str
    http: aiohttp.ClientSession

    async def call(
        self,
        method: str,
        path: str,
        *,
        token: str | None = ADMIN,
        data: bytes | io.BytesIO | None = None,
        json: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        async with self.http.request(
            method, f"{self.base}{path}", data=data, json=json, headers=sent
        ) as response:
            body = await response.json(content_type=None)
            return Reply(response.status, body, response.headers)

    async def get(self, path: str, *, token: str | None = VIEWER) -> Reply:
        return await self.call("GET", path, token=token)

    async def keyset_ids(self, path: str) -> list[int]:
        """Every item's id of a keyset-paged list, page after page (``path`` has its query,
        e.g. ``?limit=2``): each page's ``next_before`` is its last id, the last page's null."""
        ids: list[int] = []
        page_path = path
        while True:
            page = await self.get(page_path)
            assert page.status == 200, page.body
            ids += [item["id"] for item in page.body["items"]]
            cursor = page.body["next_before"]
            if cursor is None:
                return ids
            assert cursor == ids[-1], (cursor, ids)
            page_path = f"{path}&before={cursor}"
