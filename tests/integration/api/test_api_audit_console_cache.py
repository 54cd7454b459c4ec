"""The console's files after an upgrade: the page is `no-cache`, and so must be every module and
stylesheet it loads. A file served with `Last-Modified` and no explicit freshness is cached
heuristically by browsers (RFC 9111 §4.2.2: commonly a tenth of its age), so the page of the
new version would run the modules of the old one against the new API."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.api.console_route import CONSOLE_DIR
from gateway.config import TokenConfig
from tests.support.api_client import ADMIN
from tests.support.api_server import serve_api


@pytest.fixture
async def base(db_dsn: str) -> AsyncIterator[str]:
    tokens = [TokenConfig(token=ADMIN, role="admin", name="root")]
    async with serve_api(db_dsn, tokens) as api:
        yield api.base


def _revalidated(cache_control: str | None) -> bool:
    """Whether a cache must ask the server before using its copy."""
    directives = {d.strip().lower() for d in (cache_control or "").split(",")}
    return "no-cache" in directives or "no-store" in directives or "max-age=0" in directives


async def test_every_console_file_is_revalidated_before_use(base: str) -> None:
    names = sorted(p.name for p in CONSOLE_DIR.iterdir() if p.suffix in (".js", ".css"))
    assert "app.js" in names
    stale: dict[str, str | None] = {}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/") as page:
            assert page.status == 200
            assert _revalidated(page.headers.get("Cache-Control"))
        for name in names:
            async with http.get(f"{base}/console/{name}") as asset:
                assert asset.status == 200, name
                if not _revalidated(asset.headers.get("Cache-Control")):
                    stale[name] = asset.headers.get("Cache-Control")
                etag = asset.headers.get("ETag")
            # Revalidation is cheap: an unchanged file answers 304 to its validator.
            assert etag is not None, name
            async with http.get(f"{base}/console/{name}", headers={"If-None-Match": etag}) as again:
                assert again.status in (200, 304), name
    assert not stale, f"cacheable without revalidation after an upgrade: {stale}"
