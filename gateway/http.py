"""The daemon's HTTP server: health and metrics (the operator API joins it later)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.metrics import Metrics

HealthCheck = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]

HEALTH_KEY: web.AppKey[HealthCheck] = web.AppKey("health")
METRICS_KEY = web.AppKey("metrics", Metrics)


async def health(request: web.Request) -> web.Response:
    healthy, body = await request.app[HEALTH_KEY]()
    return web.json_response(body, status=200 if healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    payload, content_type = request.app[METRICS_KEY].render()
    # aiohttp wants the charset apart from the media type.
    media_type, _, _ = content_type.partition(";")
    return web.Response(body=payload, content_type=media_type, charset="utf-8")


def create_app(*, health_check: HealthCheck, registry: Metrics) -> web.Application:
    app = web.Application()
    app[HEALTH_KEY] = health_check
    app[METRICS_KEY] = registry
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


class HttpServer:
    """``async with HttpServer(app, host, port)``: listening inside, closed after."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._runner = web.AppRunner(app, access_log=None)

    async def __aenter__(self) -> HttpServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        # With port 0 the kernel picked one: report the real address.
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._runner.cleanup()
