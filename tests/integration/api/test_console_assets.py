"""The console's files as the daemon's HTTP port serves them: the page at ``/``, its modules and
stylesheet under ``/console``, nothing from another origin, no inline script, a strict CSP."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.api.console_route import CONSOLE_DIR
from gateway.config import TokenConfig
from tests.support.api_client import ADMIN
from tests.support.api_server import serve_api

IMPORT = re.compile(r"""^import\s[^;]*?from\s+["'](\./[^"']+)["'];""", re.MULTILINE)
MARKUP_SINKS = re.compile(r"\.(?:inner|outer)HTML\s*=|insertAdjacentHTML|document\.write")
URL = re.compile(r"""(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}""", re.IGNORECASE)


@pytest.fixture
async def base(db_dsn: str) -> AsyncIterator[str]:
    tokens = [TokenConfig(token=ADMIN, role="admin", name="root")]
    async with serve_api(db_dsn, tokens) as api:
        yield api.base


async def test_the_page_and_every_file_it_loads_are_served(base: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/html")
            csp = response.headers["Content-Security-Policy"]
            assert "script-src 'self'" in csp
            assert "default-src 'none'" in csp
            assert response.headers["Referrer-Policy"] == "no-referrer"
            page = await response.text()
        assert "<script>" not in page
        assert "style=" not in page
        sources = re.findall(r"""(?:src|href)=["']([^"'#][^"']*)["']""", page)
        # Relative to the page: under a reverse proxy's path prefix they stay under it.
        assert sorted(sources) == ["console/app.js", "console/style.css"]
        # Every module the entry imports, transitively, is served with a JavaScript type.
        pending, seen = ["app.js"], set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            async with http.get(f"{base}/console/{name}") as asset:
                assert asset.status == 200, name
                assert "javascript" in asset.headers["Content-Type"], name
                text = await asset.text()
            pending.extend(m.removeprefix("./") for m in IMPORT.findall(text))
        assert {
            "alarms.js",
            "api.js",
            "stream.js",
            "devices.js",
            "commands.js",
            "campaigns.js",
            "notifications.js",
        } <= seen
        async with http.get(f"{base}/console/style.css") as style:
            assert style.status == 200
            assert style.headers["Content-Type"].startswith("text/css")
        async with http.get(f"{base}/console/../pyproject.toml") as escape:
            assert escape.status == 404


def test_no_file_of_the_console_reaches_another_origin() -> None:
    files = sorted(p for p in CONSOLE_DIR.iterdir() if p.is_file())
    assert {p.name for p in files} >= {"index.html", "app.js", "style.css"}
    for path in files:
        text = path.read_text()
        # The SVG namespace (www.w3.org) is an identifier, not a fetch.
        found = [u for u in URL.findall(text) if not u.endswith("www.w3.org")]
        assert not found, (path.name, found)
        # Values reach the page as text only: no markup is ever built from a string.
        assert not MARKUP_SINKS.search(text), path.name
