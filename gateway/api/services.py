"""What the guarded routes call, filled in by the daemon once the node has a database.

The daemon starts its HTTP server before it has a database (``/health`` answers from the first
second); until the services are set the guarded routes answer 503 ``UNAVAILABLE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

import asyncpg
from litestar.di import NamedDependency

from gateway.alarms.service import AlarmService
from gateway.api.errors import UNAVAILABLE, ApiError
from gateway.commands.service import CommandService
from gateway.ingest.live_path import LivePath
from gateway.ingest.replay_process import ProcessReplay
from gateway.notify.service import NotifyService

if TYPE_CHECKING:
    from litestar import Request

    # Only for the annotation: the stream module reads the services (no import cycle).
    from gateway.api.stream import StreamHub

# What a route declares to get a service (the app's dependencies of those names).
Alarms = NamedDependency[AlarmService]
Commands = NamedDependency[CommandService]
Notifications = NamedDependency[NotifyService]
Pool = NamedDependency[asyncpg.Pool]

# The app's state key under which the routes find the services.
STATE_SERVICES: Final = "services"

T = TypeVar("T")


@dataclass(slots=True)
class Services:
    """What the guarded routes call. The daemon starts its HTTP server before it has a
    database (``/health`` answers from the first second), and sets these once it has one;
    until then the guarded routes answer 503 ``UNAVAILABLE``."""

    alarms: AlarmService | None = None
    commands: CommandService | None = None
    pool: asyncpg.Pool | None = None
    # The ingest path dead letters are replayed through (the writer's own rules engine).
    replay_path: LivePath | None = None
    # A QUARANTINED letter is replayed in a process of its own (what kills a process kills
    # that one, not the node).
    replay_process: ProcessReplay | None = None
    # What feeds GET /stream (its ``run`` loop is the daemon's to run).
    stream_hub: StreamHub | None = None
    notifications: NotifyService | None = None

    def alarm_service(self) -> AlarmService:
        return _ready(self.alarms)

    def command_service(self) -> CommandService:
        return _ready(self.commands)

    def database(self) -> asyncpg.Pool:
        return _ready(self.pool)

    def replay(self) -> LivePath:
        return _ready(self.replay_path)

    def replay_apart(self) -> ProcessReplay:
        return _ready(self.replay_process)

    def hub(self) -> StreamHub:
        return _ready(self.stream_hub)

    def notify_service(self) -> NotifyService:
        return _ready(self.notifications)


def _ready(service: T | None) -> T:
    if service is None:
        raise _starting()
    return service


def _starting() -> ApiError:
    return ApiError(UNAVAILABLE, "the node is starting (see /health); retry")


def services_of(request: Request[Any, Any, Any]) -> Services:
    services: Services = request.app.state[STATE_SERVICES]
    return services
