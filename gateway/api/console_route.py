"""The operator console: one static page at ``/``, its modules and stylesheet under ``/console``.

The files live in the package (``gateway/api/console/``, carried by the wheel as package data):
no CDN, no external font, no build step. The page talks to the same API as everyone else, with
the token the operator signs in with; it holds no secret of its own. The routes stay out of
the OpenAPI document: they serve files, not operations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from litestar import Response, get
from litestar.datastructures import CacheControlHeader
from litestar.handlers import HTTPRouteHandler
from litestar.router import Router
from litestar.static_files import create_static_files_router

CONSOLE_DIR: Final = Path(__file__).parent / "console"
ASSETS_PATH: Final = "/console"
INDEX_PATH: Final = "/"
# Only our own files, no inline script or style: a value that reaches the page's markup
# cannot run. Inline SVG built with the DOM is not affected. Frames: none.
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    # The stream's ticket travels in a URL: no page address leaves in a Referer.
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _index_html() -> bytes:
    return (CONSOLE_DIR / "index.html").read_bytes()


@get(INDEX_PATH, include_in_schema=False, sync_to_thread=False)
def console_index() -> Response[bytes]:
    """The page itself; read from the package each time (small, and a reinstall shows)."""
    return Response(_index_html(), media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


def console_routes() -> list[HTTPRouteHandler | Router]:
    """``/`` and the assets under ``/console``, for the app's route handlers.

    The assets are ``no-cache`` as the page is: served with ``Last-Modified`` and no explicit
    freshness, a browser would cache them heuristically (a tenth of their age), and after an
    upgrade the new page would load the old modules. Revalidating costs a 304 (their ETag)."""
    assets: Router = create_static_files_router(
        path=ASSETS_PATH,
        directories=[CONSOLE_DIR],
        include_in_schema=False,
        cache_control=CacheControlHeader(no_cache=True),
    )
    return [console_index, assets]
