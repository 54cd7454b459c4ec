"""Notifications, the pure part (behaviour §6): receivers and routes as configured, what an
outbox event means to people, routing with first-match and ``continue``, silences, and the
webhook signature.

Routes are read in order; the first route that matches decides, unless it says
``continue = true``, in which case the next matching route adds its receivers too (the
meaning Alertmanager gives ``continue``). A matcher left out matches everything; an event with
no severity (or rule, or device) does not match a matcher on it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta, Struct, field

from gateway.domain.errors import ConfigError
from gateway.domain.notify_match import Facts, Matchers, compile_matchers
from gateway.domain.notify_policy import (
    Grouping,
    InhibitConfig,
    InhibitRule,
    SiteConfig,
    Sites,
    compile_grouping,
    compile_inhibit,
    compile_sites,
)
from gateway.domain.redaction import url_credentials
from protocol.events import (
    AlarmChanged,
    AlarmCleared,
    AlarmCreated,
    AlarmReminder,
    AlarmSnapshot,
    CommandFinished,
    EventPayload,
    EventType,
)

# The notification events a route may name: outbox event types passed through, and two
# steps of outbox events (alarm.closed of a status change, command.failed of a finished
# command), which are no outbox event type of their own.
ALARM_CREATED: Final = EventType.ALARM_CREATED.value
ALARM_ESCALATED: Final = EventType.ALARM_ESCALATED.value
ALARM_REMINDER: Final = EventType.ALARM_REMINDER.value
ALARM_CLEARED: Final = EventType.ALARM_CLEARED.value
ALARM_CLOSED: Final = "alarm.closed"
COMMAND_FAILED: Final = "command.failed"
CAMPAIGN_ABORTED: Final = EventType.CAMPAIGN_ABORTED.value
EVENTS: Final[tuple[str, ...]] = (
    ALARM_CREATED,
    ALARM_ESCALATED,
    ALARM_REMINDER,
    ALARM_CLEARED,
    ALARM_CLOSED,
    COMMAND_FAILED,
    CAMPAIGN_ABORTED,
)
# The outbox's event types behind them.
_PASS_THROUGH: Final = frozenset(
    {ALARM_CREATED, ALARM_ESCALATED, ALARM_REMINDER, ALARM_CLEARED, CAMPAIGN_ABORTED}
)
_COMMAND_FAILURES: Final = frozenset({"FAILED", "TIMEOUT"})
# The outbox event type each notification comes from (the rest pass through by name).
_OUTBOX_TYPE: Final = {
    ALARM_CLOSED: EventType.ALARM_STATUS_CHANGED.value,
    COMMAND_FAILED: EventType.COMMAND_FINISHED.value,
}


class DeliveryStatus(StrEnum):
    PENDING = "PENDING"  # due at next_attempt_at
    SENDING = "SENDING"  # claimed by a node (lease_owner) until lease_until
    SENT = "SENT"  # the receiver accepted it
    FAILED = "FAILED"  # no attempts left; last_error says why
    SILENCED = "SILENCED"  # a silence matched when the event was consumed: never sent
    INHIBITED = "INHIBITED"  # an open alarm inhibited it (inhibited_by): never sent
    # Its alarm was shelved, or raised while its device was out of service: never sent
    # (`suppressed` says which).
    SUPPRESSED = "SUPPRESSED"


# The event of a grouped delivery: one window of a route's group, carrying its notifications.
GROUP_EVENT: Final = "notify.group"


RECEIVER_NAME_PATTERN: Final = r"^[A-Za-z0-9_.-]{1,64}$"
SIGNATURE_HEADER: Final = "X-Gateway-Signature"
EVENT_ID_HEADER: Final = "X-Gateway-Event-Id"

PositiveFloat = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
_NAME_RE: Final = re.compile(RECEIVER_NAME_PATTERN.removesuffix("$") + r"\Z")
_HEADER_RE: Final = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}\Z")
_ADDRESS_RE: Final = re.compile(r"^[^@\s<>,;]+@[^@\s<>,;]+\Z")


class ReceiverConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[notify.receivers]]`` table; `compile_notify` checks the keys its kind needs."""

    name: str
    kind: Literal["webhook", "email"]
    # webhook
    url: str = ""
    secret: str = ""
    secret_env: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    # both: seconds one attempt may take (connect, send, answer)
    timeout_s: PositiveFloat = 10.0
    # email
    host: str = ""
    port: Annotated[int, Meta(ge=0, le=65535)] = 0  # 0: 465 with tls, else 587/25
    starttls: bool = False
    tls: bool = False
    username: str = ""
    password: str = ""
    password_env: str = ""
    from_: str = field(default="", name="from")
    to: list[str] = field(default_factory=list)
    # deliveries of this receiver in flight at once, per node (0: notify.concurrency)
    concurrency: Annotated[int, Meta(ge=0)] = 0


def receiver_secrets(receiver: ReceiverConfig) -> list[str]:
    """What of a receiver is a credential, never to be logged or shown: its webhook secret,
    its SMTP password, its headers' values (an ``Authorization``, an ``X-Api-Key``), and the
    userinfo of its URL."""
    userinfo = url_credentials(receiver.url) if receiver.url else []
    found = [receiver.secret, receiver.password, *receiver.headers.values(), *userinfo]
    return [s for s in found if s]


class RouteConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[notify.routes]]`` table; an omitted matcher matches everything."""

    events: list[str] | None = None
    severities: list[str] | None = None
    rules: list[str] | None = None
    devices: str | list[str] | None = None
    receivers: list[str] = field(default_factory=list)
    continue_: bool = field(default=False, name="continue")
    # Grouping (docs/notifications.md, "Grouping"): None sends one delivery per notification.
    group_by: list[str] | None = None
    group_wait_s: Annotated[float, Meta(ge=0)] | None = None
    group_interval_s: Annotated[float, Meta(ge=0)] | None = None
    repeat_interval_s: Annotated[float, Meta(ge=0)] | None = None
    # At most this many notifications in one window's delivery (default 200).
    group_max_notifications: int | None = None


class NotifyConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[notify]`` section."""

    receivers: list[ReceiverConfig] = field(default_factory=list)
    routes: list[RouteConfig] = field(default_factory=list)
    sites: list[SiteConfig] = field(default_factory=list)
    inhibit: list[InhibitConfig] = field(default_factory=list)
    lease_s: PositiveFloat = 60.0
    max_attempts: PositiveInt = 5
    backoff_min_s: PositiveFloat = 1.0
    backoff_max_s: PositiveFloat = 300.0
    concurrency: PositiveInt = 4
    batch: PositiveInt = 100
    poll_s: PositiveFloat = 1.0


@dataclass(frozen=True, slots=True)
class Route:
    events: frozenset[str] | None
    matchers: Matchers
    receivers: tuple[str, ...]
    continue_: bool
    index: int = 0
    grouping: Grouping | None = None
    # What the route matches and how it groups, not its place, receivers or intervals
    # (route_identity): a reload that moves it in the list leaves it the same route to the
    # groups it made, and one removed is no other route's.
    identity: str = ""

    def matches(self, facts: Facts) -> bool:
        return (self.events is None or facts.event in self.events) and self.matchers.matches(facts)


@dataclass(frozen=True, slots=True)
class Notify:
    """The compiled ``[notify]`` section: receivers by name, routes in order."""

    receivers: Mapping[str, ReceiverConfig]
    routes: tuple[Route, ...]
    sites: Sites = dataclass_field(default_factory=Sites)
    inhibit: tuple[InhibitRule, ...] = ()

    def route(self, facts: Facts) -> list[str]:
        """The receivers of a notification: first match wins unless it says ``continue``."""
        return [receiver for receiver, _ in self.targets(facts)]

    def targets(self, facts: Facts) -> list[tuple[str, Route]]:
        """Each receiver of a notification with the route that chose it (a receiver chosen
        twice: by the first, whose grouping applies)."""
        return route_targets(self.routes, facts)

    def outbox_types(self) -> frozenset[str]:
        """The outbox event types some route may turn into a notification: the only ones the
        consumer needs to read. Empty without routes; every notifiable type when a route
        matches every event."""
        events: set[str] = set()
        for route in self.routes:
            events |= set(EVENTS) if route.events is None else set(route.events)
        return frozenset(_OUTBOX_TYPE.get(event, event) for event in events)


@dataclass(frozen=True, slots=True)
class Silence:
    id: int
    matchers: Matchers
    ends_at: datetime

    def silences(self, facts: Facts, at: datetime) -> bool:
        return at < self.ends_at and self.matchers.matches(facts)


def first_silence(silences: Sequence[Silence], facts: Facts, at: datetime) -> Silence | None:
    return next((s for s in silences if s.silences(facts, at)), None)


# --- compiling ---------------------------------------------------------------------------------


def route_targets(routes: Sequence[Route], facts: Facts) -> list[tuple[str, Route]]:
    """Each receiver of a notification with the route that chose it, routes in order: the
    first match wins unless it says ``continue`` (``Notify.targets``)."""
    chosen: dict[str, Route] = {}
    for route in routes:
        if not route.matches(facts):
            continue
        for receiver in route.receivers:
            chosen.setdefault(receiver, route)
        if not route.continue_:
            break
    return list(chosen.items())


_GROUP_ROUTE_RE: Final = re.compile(r"routes\[([0-9]+)\]")


def _labels_fit(matchers: Matchers, labels: Mapping[str, str]) -> bool:
    """Whether a group's labels (its values of ``group_by``) are ones the matchers accept; a
    label the group lacks (or leaves empty) accepts anything."""
    rule, device, severity = labels.get("rule"), labels.get("device"), labels.get("severity")
    if rule and matchers.rules is not None and rule not in matchers.rules:
        return False
    if device and matchers.devices is not None and not matchers.devices.matches(device):
        return False
    return not (
        severity and matchers.severities is not None and severity not in matchers.severities
    )


def reminding_route(
    routes: Sequence[Route], receiver: str, notification: Mapping[str, Any]
) -> Route | None:
    """The route that sends ``receiver`` this notification now (a group's member body: its
    ``event``, ``device_id``, ``rule_key``, ``severity``; the route choosing the receiver, as
    ``Notify.targets``) if it groups and repeats; else None. The alarm of a route that moved
    off a group's place, whose group row the route moved into that place took over, is
    still that route's to remind of: by that group until one of the route's own carries it."""
    facts = Facts(
        event=notification.get("event") or "",
        device_id=notification.get("device_id"),
        rule_key=notification.get("rule_key"),
        severity=notification.get("severity"),
        alarm_id=notification.get("alarm_id"),
    )
    route = dict(route_targets(routes, facts)).get(receiver)
    if route is None or route.grouping is None or not route.grouping.repeat_s > 0:
        return None
    return route


def route_of_group(
    routes: Sequence[Route],
    *,
    receiver: str,
    group_key: str,
    labels: Mapping[str, str],
    identity: str | None,
) -> Route | None:
    """The route a stored group repeats for now (docs/notifications.md, "A reload re-times
    the groups"), among the grouping routes that list its receiver: the first of its
    ``identity`` (what the route matches and how it groups, wherever it stands now); else
    the route at the place the group's key begins with (``routes[N]``, the place it had),
    provided the group's labels are ones that route accepts (a route edited in place, or a
    group made before identities were stored); else none (the route removed, or another in
    its place, or the receiver taken off it): the group repeats no more."""
    grouping = [r for r in routes if r.grouping is not None and receiver in r.receivers]
    if identity:
        for route in grouping:
            if route.identity == identity:
                return route
    placed = _GROUP_ROUTE_RE.match(group_key)
    if placed is None:
        return None
    position = int(placed.group(1))
    for route in grouping:
        if route.index == position and _labels_fit(route.matchers, labels):
            return route
    return None


def route_identity(route: RouteConfig) -> str:
    """What a route matches and how it groups, as a short digest: its events, rules,
    devices, severities and group_by (each list as a set, but group_by, whose order makes the
    group's key). Its receivers, ``continue`` and intervals are not part of it."""

    def each(values: str | list[str] | None) -> list[str] | None:
        if values is None:
            return None
        return sorted({values} if isinstance(values, str) else set(values))

    what = [
        each(route.events),
        each(route.rules),
        each(route.devices),
        each(route.severities),
        route.group_by,
    ]
    return hashlib.sha256(msgspec.json.encode(what)).hexdigest()[:32]


def compile_notify(config: NotifyConfig, path: str = "notify") -> Notify:
    """Validate the section; a `ConfigError` names the offending key."""
    if config.backoff_min_s > config.backoff_max_s:
        raise ConfigError(f"{path}.backoff_min_s", f"must not exceed {path}.backoff_max_s")
    receivers: dict[str, ReceiverConfig] = {}
    for index, receiver in enumerate(config.receivers):
        at = f"{path}.receivers[{index}]"
        if _NAME_RE.match(receiver.name) is None:
            raise ConfigError(f"{at}.name", "must match ^[A-Za-z0-9_.-]{1,64}$")
        if receiver.name in receivers:
            raise ConfigError(f"{at}.name", f"receiver {receiver.name!r} is defined twice")
        _check_receiver(receiver, at)
        if receiver.timeout_s >= config.lease_s:
            # A send still running when its lease ends would be sent again by another node.
            raise ConfigError(f"{at}.timeout_s", f"must be shorter than {path}.lease_s")
        receivers[receiver.name] = receiver
    sites = compile_sites(config.sites, f"{path}.sites")
    routes = []
    for index, route in enumerate(config.routes):
        at = f"{path}.routes[{index}]"
        if route.events is not None:
            if not route.events:
                raise ConfigError(f"{at}.events", "must not be empty (leave it out)")
            for n, event in enumerate(route.events):
                if event not in EVENTS:
                    raise ConfigError(
                        f"{at}.events[{n}]", f"unknown event {event!r}; known: {list(EVENTS)}"
                    )
        for n, name in enumerate(route.receivers):
            if name not in receivers:
                raise ConfigError(
                    f"{at}.receivers[{n}]",
                    f"unknown receiver {name!r}; defined: {sorted(receivers)}",
                )
        routes.append(
            Route(
                events=None if route.events is None else frozenset(route.events),
                matchers=compile_matchers(
                    rules=route.rules, devices=route.devices, severities=route.severities, path=at
                ),
                receivers=tuple(dict.fromkeys(route.receivers)),
                continue_=route.continue_,
                index=index,
                identity=route_identity(route),
                grouping=compile_grouping(
                    group_by=route.group_by,
                    wait_s=route.group_wait_s,
                    interval_s=route.group_interval_s,
                    repeat_s=route.repeat_interval_s,
                    path=at,
                    sites=sites,
                    max_notifications=route.group_max_notifications,
                ),
            )
        )
    return Notify(
        receivers=receivers,
        routes=tuple(routes),
        sites=sites,
        inhibit=compile_inhibit(config.inhibit, f"{path}.inhibit", sites),
    )


def _check_receiver(receiver: ReceiverConfig, at: str) -> None:
    if receiver.kind == "webhook":
        _check_webhook(receiver, at)
    else:
        _check_email(receiver, at)


def _check_webhook(receiver: ReceiverConfig, at: str) -> None:
    if not re.match(r"^https?://[^/\s]+", receiver.url):
        raise ConfigError(f"{at}.url", "a webhook needs an http:// or https:// url")
    # One no request can be made to (an unclosed "[", a port that is none, no host) is refused
    # here, naming the key. Before, urlsplit's ValueError left the check (no ConfigError: a
    # traceback from check-config and at start, and the SIGHUP handler catches ConfigError
    # only), or the url was accepted and every delivery failed. No message quotes the url.
    try:
        parts = urlsplit(receiver.url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not 0-65535
    except ValueError as error:
        raise ConfigError(
            f"{at}.url", "not a valid url: a host, and a port (0-65535) if it names one"
        ) from error
    if not parts.hostname or "\\" in parts.netloc:
        raise ConfigError(f"{at}.url", "a webhook url needs a host")
    if receiver.secret and receiver.secret_env:
        raise ConfigError(f"{at}.secret_env", "set at most one of secret and secret_env")
    if "@" in parts.netloc and any(name.lower() == "authorization" for name in receiver.headers):
        # The HTTP client makes Basic auth of the userinfo and refuses to send both: every
        # attempt would fail. Neither value is quoted: both are secrets.
        raise ConfigError(
            f"{at}.url",
            f"receiver {receiver.name!r} has credentials in its url (user:password@) and an "
            "Authorization header: give only one of them",
        )
    for name, value in receiver.headers.items():
        if _HEADER_RE.match(name) is None:
            raise ConfigError(f"{at}.headers", f"invalid header name {name!r}")
        if "\r" in value or "\n" in value:
            raise ConfigError(f"{at}.headers.{name}", "a header value may not hold a line break")


def _check_email(receiver: ReceiverConfig, at: str) -> None:
    if not receiver.host:
        raise ConfigError(f"{at}.host", "an email receiver needs the SMTP host")
    if receiver.tls and receiver.starttls:
        raise ConfigError(f"{at}.starttls", "tls (implicit TLS) and starttls exclude each other")
    if receiver.password and receiver.password_env:
        raise ConfigError(f"{at}.password_env", "set at most one of password and password_env")
    if _ADDRESS_RE.match(receiver.from_) is None:
        raise ConfigError(f"{at}.from", "an email receiver needs a sender address")
    if not receiver.to:
        raise ConfigError(f"{at}.to", "an email receiver needs at least one recipient")
    for index, address in enumerate(receiver.to):
        if _ADDRESS_RE.match(address) is None:
            raise ConfigError(f"{at}.to[{index}]", f"invalid address {address!r}")


# --- what an outbox event means to people ------------------------------------------------------


def notification_of(event_type: str, event: EventPayload) -> Facts | None:
    """The notification an outbox event (its payload decoded for its type) is, or None (most
    status changes are not one)."""
    match event:
        case AlarmChanged(alarm=alarm) if event_type == EventType.ALARM_STATUS_CHANGED:
            return _alarm_facts(ALARM_CLOSED, alarm) if alarm.status == "CLOSED" else None
        case CommandFinished(command=command):
            return _command_failed(command)
        case _ if event_type not in _PASS_THROUGH:
            return None
        case AlarmCreated(alarm=alarm) | AlarmChanged(alarm=alarm) | AlarmReminder(alarm=alarm):
            return _alarm_facts(event_type, alarm)
        case AlarmCleared(alarm_id=alarm_id, device_id=device_id, rule_key=rule_key):
            return Facts(
                event=event_type, device_id=device_id, rule_key=rule_key, alarm_id=alarm_id
            )
    return Facts(event=event_type)  # campaign.aborted: about no alarm or device


def _command_failed(command: Mapping[str, Any]) -> Facts | None:
    if command.get("status") not in _COMMAND_FAILURES:
        return None
    return Facts(event=COMMAND_FAILED, device_id=_text(command.get("device_id")))


def _alarm_facts(event: str, alarm: AlarmSnapshot) -> Facts:
    return Facts(
        event=event,
        device_id=alarm.device_id,
        rule_key=alarm.rule_key,
        severity=alarm.severity,
        alarm_id=alarm.id,
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def alarm_link(public_url: str, alarm_id: int | None) -> str | None:
    """The console's page of the alarm, when ``[http] public_url`` is set."""
    if not public_url or alarm_id is None:
        return None
    return f"{public_url.rstrip('/')}/#/alarms/{alarm_id}"


# --- the webhook signature ---------------------------------------------------------------------


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """``t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def verify_signature(secret: str, header: str, body: bytes, *, now: int, tolerance_s: int) -> bool:
    """What a receiver does: the HMAC matches and the timestamp is recent (no replay)."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > tolerance_s:
        return False
    expected = signature(secret, timestamp, body)
    return hmac.compare_digest(expected, f"t={parts['t']},v1={parts.get('v1', '')}")


def silence_from_row(row: Mapping[str, Any]) -> Silence:
    """A stored silence (its matchers were validated when it was created)."""
    raw = row["matchers"]
    matchers: dict[str, Any] = msgspec.json.decode(raw) if isinstance(raw, str) else dict(raw)
    return Silence(
        id=int(row["id"]),
        matchers=compile_matchers(
            rules=matchers.get("rules"),
            devices=matchers.get("devices"),
            severities=matchers.get("severities"),
            path="matchers",
        ),
        ends_at=row["ends_at"],
    )
