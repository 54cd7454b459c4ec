"""Configuration: one TOML file decoded into a tree of frozen msgspec structs.

Unknown keys and wrong types are errors naming the key path; every error in the file is
reported at once (:class:`ConfigErrors`), an enum error with the allowed values. Secrets
(database DSN, MQTT credentials) may come from the environment or from systemd credentials
instead of the file.

Entry points: ``load_config``, ``Config``, ``ConfigError``/``ConfigErrors``. May import
``support``, ``domain`` and ``protocol``; nothing above it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args, get_origin
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta, Struct, field

from gateway.domain.ai_prompt import PROMPTS
from gateway.domain.errors import ConfigError, ConfigErrors, config_errors
from gateway.domain.mappings import MappingConfig, Mappings, compile_mappings
from gateway.domain.notify import Notify, NotifyConfig, compile_notify, receiver_secrets
from gateway.domain.quiet_hours import QuietHours, QuietHoursConfig, compile_quiet_hours
from gateway.domain.redaction import url_credentials, userinfo_cut
from gateway.domain.rules import DeviceClock, RuleConfig, RuleSet, compile_rule, compile_rules
from protocol import TopicKind, Topics, is_valid_device_id
from protocol.ids import is_portable_device_id
from storage.pool import dsn_password

Port = Annotated[int, Meta(ge=1, le=65535)]
# [mqtt] broker_family values whose brokers map `.` in topics to their own separators.
_DOTTED: Final = frozenset({"rabbitmq", "nats"})
PositiveInt = Annotated[int, Meta(ge=1)]
PositiveFloat = Annotated[float, Meta(gt=0)]

ENV_DATABASE_DSN: Final = "GATEWAY_DATABASE_DSN"
ENV_MQTT_USERNAME: Final = "GATEWAY_MQTT_USERNAME"
ENV_MQTT_PASSWORD: Final = "GATEWAY_MQTT_PASSWORD"  # noqa: S105 - a variable name
# Files of the same names under $CREDENTIALS_DIRECTORY (systemd LoadCredential=).
CREDENTIAL_DATABASE_DSN: Final = "database_dsn"
CREDENTIAL_MQTT_PASSWORD: Final = "mqtt_password"  # noqa: S105 - a file name


class NodeConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    id: str = ""
    state_dir: str = ""


class TlsConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure: bool = False


class MqttConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    host: str = ""
    port: Port = 1883
    # The broker's endpoints, tried in order ("host:port", "[v6]:port"; a missing port is
    # `port`): the first that answers, the next on a loss. Excludes `host` (validate).
    hosts: list[str] = field(default_factory=list)
    topic_prefix: str = "iot"
    client_id: str = ""
    username: str = ""
    password: str = ""
    tls: TlsConfig = field(default_factory=TlsConfig)
    protocol: Literal["3.1.1", "5"] = "5"
    shared_group: str = ""
    # MQTT carries the Keep Alive in two bytes: 65,535 s (about 18 h) at most.
    keepalive_s: Annotated[int, Meta(ge=1, le=65535)] = 30
    session_expiry_s: Annotated[int, Meta(ge=0, le=4294967295)] = 86400
    receive_maximum: Annotated[int, Meta(ge=1, le=65535)] = 1000
    broker_inflight: PositiveInt = 20
    encoding: Literal["json", "msgpack"] = "json"
    max_payload_bytes: PositiveInt = 65536
    # The largest packet the gateway publishes (0: only the broker's MQTT 5 CONNACK bounds it).
    # Set it to the broker's limit (mosquitto: message_size_limit) when the broker does not say
    # it, as on 3.1.1: a downlink over it fails its command, and the API refuses params that
    # cannot fit it (docs/deploying.md).
    max_packet_size: Annotated[int, Meta(ge=0, le=268_435_460)] = 0
    # The broker's kind, where it changes what a topic may hold: RabbitMQ and NATS map `.` to
    # their own separators, so there device ids (and the node id) must hold no `.`: refused at
    # the API, dead-lettered BAD_DEVICE_ID from topics (docs/deploying.md).
    broker_family: Literal["generic", "rabbitmq", "nats"] = "generic"
    reconnect_min_s: PositiveFloat = 0.5
    reconnect_max_s: PositiveFloat = 30.0
    # MQTT 3.1.1 only: how long a probe proving a subscription may take (0: no probe).
    probe_timeout_s: Annotated[float, Meta(ge=0)] = 10.0


class DatabaseConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    dsn: str = ""
    pool_min: PositiveInt = 2
    pool_max: PositiveInt = 10
    connect_timeout_s: PositiveFloat = 10.0
    retry_min_s: PositiveFloat = 0.2
    retry_max_s: PositiveFloat = 10.0


class IngestConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    batch_max: PositiveInt = 500
    linger_ms: Annotated[int, Meta(ge=0, le=10_000)] = 5
    # 0: 2 for a node alone, 1 in a shared subscription group (see transactions_in_flight()).
    transactions_in_flight: Annotated[int, Meta(ge=0, le=8)] = 0
    queue_max: PositiveInt = 2000
    read_buffer: Annotated[int, Meta(ge=2)] = 1000
    read_buffer_bytes: Annotated[int, Meta(ge=2)] = 16 * 1024 * 1024
    drain_timeout_s: PositiveFloat = 20.0
    refused_batch_attempts: PositiveInt = 5
    dead_letter_max_bytes: Annotated[int, Meta(ge=0)] = 65536
    # Vendor JSON devices on their own topics (docs/devices.md): each read into telemetry,
    # presence and commands by its keys or a built-in profile. Reloaded on SIGHUP.
    mappings: list[MappingConfig] = field(default_factory=list)


class HttpConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080  # 0: any free port
    # Where people reach the console (http(s)://host[:port][/path]); notifications link to it.
    public_url: str = ""
    # Live streams (GET /stream) open at once on this node, in all and per token: each costs a
    # socket, its send buffers and a share of every event's fan-out.
    max_streams: PositiveInt = 100
    max_streams_per_token: PositiveInt = 10


class LogConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    format: Literal["auto", "json", "console"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"


class TokenConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    token: str = ""
    token_env: str = ""
    role: Literal["viewer", "operator", "admin"] = "viewer"
    # Required (validate): who the audit trail names for whatever the token does.
    name: str = ""


class ApiConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    tokens: list[TokenConfig] = field(default_factory=list)


class AlarmFiguresConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """[alarms.figures]: the alarm system's own figures (docs/alarm-figures.md). The defaults
    are the alarm-management standards' (EEMUA 191, ISA-18.2 / IEC 62682)."""

    # A fixed 10-minute interval holding more alarms than this is part of a flood.
    flood_alarms: PositiveInt = 10
    # A (rule, device) raising this many alarms within chatter_window_s is chattering.
    chatter_raises: Annotated[int, Meta(ge=2)] = 3
    chatter_window_s: PositiveFloat = 60.0
    # An alarm open for longer than this is stale.
    stale_after_s: PositiveFloat = 86400.0
    # The average rate the figures are held against (alarms per 10 minutes).
    target_per_10min: PositiveFloat = 1.0
    # How often every node samples the figures' gauges (a few cheap indexed counts), and how
    # far back the chattering gauge looks.
    interval_s: Annotated[float, Meta(ge=1)] = 60.0
    chatter_lookback_s: PositiveFloat = 3600.0


class AlarmsConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    escalate_after_s: Annotated[float, Meta(ge=0)] = 0.0
    repeat_interval_s: Annotated[float, Meta(ge=0)] = 0.0
    # An alarm still NEW this long after it fired reached nobody (docs/behaviour.md §5): logged
    # once as `alarm_unreached`, counted and audited (0: never).
    unreached_after_s: Annotated[float, Meta(ge=0)] = 300.0
    timer_interval_s: PositiveFloat = 5.0
    # A rule whose metric or event no telemetry carried for this long is logged once (0: never).
    rule_check_after_s: Annotated[float, Meta(ge=0)] = 3600.0
    # Device clocks (docs/rules-and-alarms.md): a sample dated further ahead of its receipt, or
    # further back than the newest judged for its rules, is judged at its receipt.
    max_future_skew_s: Annotated[float, Meta(ge=0)] = 300.0
    reorder_window_s: Annotated[float, Meta(ge=0)] = 300.0
    # The longest an operator may shelve an alarm (or a device's rule) for, in seconds.
    shelve_max_s: PositiveFloat = 86400.0
    # The most alarms one bulk action (POST /alarms/bulk) acts on; more is refused whole.
    bulk_max: Annotated[int, Meta(ge=1, le=10_000)] = 500
    quiet_hours: QuietHoursConfig = field(default_factory=QuietHoursConfig)
    figures: AlarmFiguresConfig = field(default_factory=AlarmFiguresConfig)


class CommandsConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    lease_s: PositiveFloat = 30.0
    ack_window_s: Annotated[float, Meta(ge=0)] = 30.0
    sent_timeout_s: PositiveFloat = 86400.0
    expire_after_s: PositiveFloat = 259200.0
    max_in_flight_per_device: PositiveInt = 1
    dispatch_batch: PositiveInt = 100
    reaper_interval_s: PositiveFloat = 5.0


class OutboxConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    retry_min_s: PositiveFloat = 1.0
    retry_max_s: PositiveFloat = 300.0


class AiConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = False
    base_url: str = ""
    model: str = ""
    # The key, or the variable holding it (read into api_key by apply_secrets); at most one.
    api_key: str = ""
    api_key_env: str = ""
    prompt_version: str = "v1"
    timeout_s: PositiveFloat = 30.0
    max_attempts: PositiveInt = 3
    workers: PositiveInt = 2
    json_mode: bool = True
    processing_timeout_s: PositiveFloat = 300.0


# --- [retention] ----------------------------------------------------------------------------------
# Days to keep each kind of row; 0 keeps it forever. Live rows are never pruned, whatever
# their age (see gateway/maintenance and docs/operations.md#retention-and-disk).
RetentionDays = Annotated[int, Meta(ge=0, le=36500)]


class RetentionConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    telemetry_days: RetentionDays = 30
    dead_letter_days: RetentionDays = 30
    audit_days: RetentionDays = 365
    receipts_days: RetentionDays = 90
    outbox_days: RetentionDays = 7
    # DEAD outbox events (the broker can never take them), counted from when they died.
    outbox_dead_days: RetentionDays = 30
    ai_payload_days: RetentionDays = 30
    notify_days: RetentionDays = 90
    partitions_ahead_days: Annotated[int, Meta(ge=1, le=366)] = 7
    interval_s: Annotated[float, Meta(ge=10)] = 3600.0


# --- end of [retention] ---------------------------------------------------------------------------


# [sparkplug] reorder_window_s when unset in a shared subscription group (docs/sparkplug.md).
SHARED_REORDER_WINDOW_S: Final = 5.0


class SparkplugConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """[sparkplug]: the gateway as a Sparkplug B host application (docs/sparkplug.md)."""

    enabled: bool = False
    # Sparkplug group ids to consume (`spBv1.0/{group}/#` each); empty: every group (`spBv1.0/#`).
    groups: list[str] = field(default_factory=list)
    # The host application id: STATE is published on `spBv1.0/STATE/{host_id}`.
    host_id: str = ""
    # How long a `seq` missing from an edge node's stream may stay missing before it counts as
    # a gap (0: at once). Nodes of a `$share` group see one node's stream in pieces, out of
    # order; there a few seconds keep reordering from passing for loss. Unset: see
    # Config.sparkplug_reorder_window_s.
    reorder_window_s: Annotated[float, Meta(ge=0, le=3600)] | None = None
    # Seconds between two rebirth requests to one edge node that has not answered yet.
    rebirth_retry_s: PositiveFloat = 30.0
    # The largest NBIRTH or DBIRTH accepted, in bytes ([mqtt] max_payload_bytes bounds every
    # other message; a smaller value here counts as that). A birth names and types every
    # metric: an edge node with thousands of tags sends births far larger than its data, and
    # one refused is never born, asked for a rebirth every rebirth_retry_s, answered by the
    # same birth, its data dead-lettered meanwhile.
    max_birth_bytes: PositiveInt = 1_048_576
    # Seconds between passes of the loop that sends rebirth requests.
    interval_s: PositiveFloat = 1.0


class Config(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    node: NodeConfig = field(default_factory=NodeConfig)
    mqtt: MqttConfig = field(default_factory=MqttConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    log: LogConfig = field(default_factory=LogConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    rules: list[RuleConfig] = field(default_factory=list)
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)
    commands: CommandsConfig = field(default_factory=CommandsConfig)
    outbox: OutboxConfig = field(default_factory=OutboxConfig)
    ai: AiConfig = field(default_factory=AiConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    sparkplug: SparkplugConfig = field(default_factory=SparkplugConfig)

    @property
    def node_id(self) -> str:
        if self.node.id:
            return self.node.id
        # A host name's dots would not survive a broker that maps them (see broker_family).
        name = default_node_id()
        return name.replace(".", "-") if self.mqtt.broker_family in _DOTTED else name

    @property
    def state_dir(self) -> Path:
        if self.node.state_dir:
            return Path(self.node.state_dir)
        # systemd's StateDirectory= exports the path; otherwise stay next to the caller.
        return Path(os.environ.get("STATE_DIRECTORY", ".gateway-state")).resolve()

    def secrets(self) -> list[str]:
        """What no log line may carry: the API tokens, the broker's and the database's
        passwords, the AI server's key and URL userinfo, the notification receivers'
        secrets."""
        return [
            *(t.token for t in self.api.tokens),
            self.mqtt.password,
            # Read even from a DSN urlsplit refuses (it raised here, at every start and
            # reload: a raw traceback).
            dsn_password(self.database.dsn),
            self.ai.api_key,
            *url_credentials(self.ai.base_url),
            *notify_secrets(self),
        ]

    def mappings(self) -> Mappings:
        """The compiled ``[[ingest.mappings]]`` (validated already: see ``validate``)."""
        return compile_mappings(
            self.ingest.mappings,
            native_filters=native_filters(self.topics),
            portable_ids=self.mqtt.broker_family in _DOTTED,
        )

    def rule_set(self) -> RuleSet:
        return compile_rules(self.rules)

    def device_clock(self) -> DeviceClock:
        return DeviceClock(
            max_future_skew=datetime.timedelta(seconds=self.alarms.max_future_skew_s),
            reorder_window=datetime.timedelta(seconds=self.alarms.reorder_window_s),
        )

    def quiet_hours(self) -> QuietHours | None:
        if not self.alarms.quiet_hours.windows:
            return None
        return compile_quiet_hours(self.alarms.quiet_hours)

    def notify_rules(self) -> Notify:
        return compile_notify(self.notify)

    @property
    def topics(self) -> Topics:
        return Topics(self.mqtt.topic_prefix, portable_ids=self.mqtt.broker_family in _DOTTED)

    def transactions_in_flight(self) -> int:
        """Ingest transactions open at once (``[ingest] transactions_in_flight``; 0: chosen).

        Chosen: two for a node alone, where one batch's evaluation overlaps another's
        statements (docs/performance.md: +19 to 30 % drain rate, latency and storm time down
        by a quarter to two fifths); one in a shared subscription group, where the nodes'
        transactions already overlap and more of them put a device's samples further out of
        order across the nodes (three nodes on one machine: 15 % slower, PostgreSQL's CPU
        per message up 18 %)."""
        chosen = self.ingest.transactions_in_flight
        if chosen:
            return chosen
        return 1 if self.mqtt.shared_group else 2

    def sparkplug_reorder_window_s(self) -> float:
        """[sparkplug] reorder_window_s as set; unset, SHARED_REORDER_WINDOW_S in a shared
        subscription group ([mqtt] shared_group), 0 alone. The nodes of a group each commit
        part of an edge node's stream, concurrently: a seq often commits before the one
        that precedes it, and at 0 each such reorder was a gap, the edge node untrusted and
        asked for a rebirth (again after each rebirth: about one a second per busy node)."""
        chosen = self.sparkplug.reorder_window_s
        if chosen is not None:
            return chosen
        return SHARED_REORDER_WINDOW_S if self.mqtt.shared_group else 0.0

    def batch_size(self, protocol: str) -> int:
        """Messages per transaction: at most half the broker's window of unacked messages.

        The broker stops sending once that window is full of messages we have not acked
        yet, so a batch larger than the window would never fill; half lets the next batch
        fill while the previous one commits. ``protocol`` is the one actually spoken (the
        embedded broker speaks 3.1.1 whatever the file says).
        """
        window = self.mqtt.receive_maximum if protocol == "5" else self.mqtt.broker_inflight
        return max(1, min(self.ingest.batch_max, window // 2))


def native_filters(topics: Topics) -> list[str]:
    """Every topic filter of the gateway's own topics, which no mapping may match."""
    return [
        *(topics.subscription(kind) for kind in TopicKind),
        f"{topics.prefix}/events/+/+",
        f"{topics.prefix}/gateways/+/status",
    ]


def broker_endpoints(mqtt: MqttConfig) -> list[tuple[str, int]]:
    """The broker endpoints to try, in order: ``[mqtt] hosts``, or ``[mqtt] host`` and
    ``port``; empty for the embedded broker (neither set). Raises :class:`ConfigError` for an
    entry that does not parse (``validate`` has reported it already)."""
    if mqtt.hosts:
        return [
            parse_endpoint(entry, mqtt.port, f"mqtt.hosts[{index}]")
            for index, entry in enumerate(mqtt.hosts)
        ]
    return [(mqtt.host, mqtt.port)] if mqtt.host else []


_ENDPOINT: Final = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]*:[0-9A-Fa-f:.%\w]*)\]|(?P<name>[^\s\[\]:/@]+))"
    r"(?::(?P<port>\d{1,5}))?\Z"
)
# `[mqtt] host`: a name or an IPv4 address (an IPv6 one is checked by ipaddress).
_HOST_NAME: Final = re.compile(r"^[^\s\[\]:/@]+\Z")


def _shown_endpoint(text: str) -> str:
    """``text`` for an error message: a user (and password) written before ``@`` cut out."""
    return repr(f"[redacted]@{text.rpartition('@')[2]}" if "@" in text else text)


def parse_endpoint(text: str, default_port: int, key_path: str) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` as (host, port); a missing port is
    ``default_port``. An IPv6 address needs its brackets (``::1:1883`` cannot be split)."""
    match = _ENDPOINT.match(text.strip())
    if match is None:
        hint = "; write an IPv6 address in brackets: [::1]:1883" if text.count(":") > 1 else ""
        if "@" in text:
            hint = "; the user name and password go in [mqtt] username and password"
        raise ConfigError(key_path, f"{_shown_endpoint(text)} is not host:port{hint}")
    port_text = match.group("port")
    port = default_port if port_text is None else int(port_text)
    if not 1 <= port <= 65535:
        raise ConfigError(key_path, f"{_shown_endpoint(text)}: the port must be 1 to 65535")
    return match.group("v6") or match.group("name"), port


def endpoint_label(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (as in ``[mqtt] hosts``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def default_node_id() -> str:
    name = re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname())[:64]
    return name or "gateway"


_AT_PATH: Final = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_FIELD: Final = re.compile(r"(?:unknown|required) field `(?P<field>[^`]+)`")


def _key_path(error: msgspec.ValidationError, prefix: str = "") -> ConfigError:
    match = _AT_PATH.match(str(error))
    assert match is not None  # the pattern matches any string
    message = match.group("message")
    path = (match.group("path") or "").lstrip(".")
    field_match = _FIELD.search(message)
    if field_match:
        path = f"{path}.{field_match.group('field')}" if path else field_match.group("field")
    if prefix:
        path = f"{prefix}{'' if not path or path.startswith('[') else '.'}{path}"
    return ConfigError(path or "<root>", message)


def parse_config(text: str | bytes) -> Config:
    try:
        config = msgspec.toml.decode(text, type=Config)
    except msgspec.ValidationError as exc:
        # msgspec stops at the first mistake: walk the file key by key for all of them.
        raw = msgspec.toml.decode(text)
        raise config_errors(_type_errors(raw, Config, "") or [_key_path(exc)]) from exc
    except msgspec.DecodeError as exc:
        raise ConfigError("<toml>", str(exc)) from exc
    validate(config)
    return config


def _type_errors(value: Any, kind: Any, path: str) -> list[ConfigError]:
    """Every type error in ``value`` read as ``kind``: struct fields and list items one by
    one, so that one mistake does not hide the next."""
    if isinstance(kind, type) and issubclass(kind, Struct) and isinstance(value, dict):
        errors: list[ConfigError] = []
        fields = {f.encode_name: f for f in msgspec.structs.fields(kind)}
        for key, item in value.items():
            at = f"{path}.{key}" if path else key
            if key not in fields:
                errors.append(ConfigError(at, "unknown field"))
            else:
                errors.extend(_type_errors(item, fields[key].type, at))
        for name, info in fields.items():
            required = (
                info.default is msgspec.NODEFAULT and info.default_factory is msgspec.NODEFAULT
            )
            if required and name not in value:
                errors.append(ConfigError(f"{path}.{name}" if path else name, "required field"))
        return errors
    if get_origin(kind) is list and isinstance(value, list):
        (item_kind,) = get_args(kind)
        return [
            error
            for index, item in enumerate(value)
            for error in _type_errors(item, item_kind, f"{path}[{index}]")
        ]
    try:
        msgspec.convert(
            value,
            kind,
            builtin_types=(datetime.datetime, datetime.date, datetime.time),
            str_keys=True,
        )
    except msgspec.ValidationError as exc:
        error = _key_path(exc, path)
        if get_origin(kind) is Literal:
            allowed = ", ".join(repr(choice) for choice in get_args(kind))
            error = ConfigError(error.key_path, f"{error.message}; allowed: {allowed}")
        return [error]
    return []


def load_config(path: Path | None, environ: Mapping[str, str] | None = None) -> Config:
    """Read, decode and validate the file (``None``: every default), then apply secrets."""
    text = b""
    if path is not None:
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ConfigError("<file>", f"cannot read {path}: {exc.strerror}") from exc
    return apply_secrets(parse_config(text), os.environ if environ is None else environ)


def apply_secrets(config: Config, environ: Mapping[str, str]) -> Config:
    """Environment variables win over credentials files, which win over the TOML file."""
    credentials = environ.get("CREDENTIALS_DIRECTORY")

    def secret(key: str, env_name: str, credential: str | None, current: str) -> str:
        if environ.get(env_name):
            return environ[env_name]
        if credentials and credential:
            candidate = Path(credentials) / credential
            if candidate.is_file():
                try:
                    return candidate.read_text(encoding="utf-8").strip()
                except (OSError, UnicodeDecodeError) as exc:
                    # A configuration error naming the key, as an unset variable is (it was
                    # a traceback: check-config crashed, a start died, a reload escaped).
                    why = exc.strerror if isinstance(exc, OSError) else f"not UTF-8 ({exc.reason})"
                    raise ConfigError(
                        key, f"cannot read the credential {candidate}: {why}"
                    ) from None
        return current

    database = msgspec.structs.replace(
        config.database,
        dsn=secret("database.dsn", ENV_DATABASE_DSN, CREDENTIAL_DATABASE_DSN, config.database.dsn),
    )
    mqtt = msgspec.structs.replace(
        config.mqtt,
        username=secret("mqtt.username", ENV_MQTT_USERNAME, None, config.mqtt.username),
        password=secret(
            "mqtt.password", ENV_MQTT_PASSWORD, CREDENTIAL_MQTT_PASSWORD, config.mqtt.password
        ),
    )
    tokens = []
    secrets_seen: dict[str, int] = {}
    for index, entry in enumerate(config.api.tokens):
        if entry.token_env:
            value = environ.get(entry.token_env, "")
            if not value:
                raise ConfigError(
                    f"api.tokens[{index}].token_env",
                    f"environment variable {entry.token_env} is not set",
                )
            if len(value) < TOKEN_MIN_LENGTH:
                # As a token written in the file (never the value in the message).
                raise ConfigError(
                    f"api.tokens[{index}].token_env",
                    f"environment variable {entry.token_env} must hold at least "
                    f"{TOKEN_MIN_LENGTH} characters",
                )
            entry = msgspec.structs.replace(entry, token=value)  # noqa: PLW2901 - the resolved copy
        if entry.token in secrets_seen:
            # One secret, two names and roles: the caller would be whichever table came first.
            raise ConfigError(
                f"api.tokens[{index}]",
                f"the same token as api.tokens[{secrets_seen[entry.token]}]: each token needs "
                "its own secret",
            )
        secrets_seen[entry.token] = index
        tokens.append(entry)
    api = msgspec.structs.replace(config.api, tokens=tokens)
    notify = _notify_secrets(config.notify, environ)
    ai = _ai_secrets(config.ai, environ)
    return msgspec.structs.replace(
        config, database=database, mqtt=mqtt, api=api, ai=ai, notify=notify
    )


# What an HTTP header value cannot carry (aiohttp refuses the request with a ValueError).
_CONTROL: Final = re.compile("[\x00-\x1f\x7f]")


def _ai_secrets(ai: AiConfig, environ: Mapping[str, str]) -> AiConfig:
    """``api_key_env`` read into ``api_key`` (with AI enabled: a disabled section sends no key,
    so its variable may be missing)."""
    if not ai.enabled or not ai.api_key_env:
        return ai
    # Around the key, whitespace is no part of it: a variable filled from a file keeps the
    # file's last newline (a Kubernetes secret made with --from-file), as a credentials file
    # read here is stripped.
    value = environ.get(ai.api_key_env, "").strip()
    if not value:
        raise ConfigError("ai.api_key_env", f"environment variable {ai.api_key_env} is not set")
    if _CONTROL.search(value):
        raise ConfigError(
            "ai.api_key_env",
            f"environment variable {ai.api_key_env} holds a control character (an HTTP header"
            " cannot carry it)",
        )
    # The value replaces the variable's name: the resolved section has one of the two.
    return msgspec.structs.replace(ai, api_key=value, api_key_env="")


# --- notifications ([notify], [http] public_url) ------------------------------------------------


def _notify_secrets(notify: NotifyConfig, environ: Mapping[str, str]) -> NotifyConfig:
    """Each receiver's ``secret_env`` / ``password_env`` read into ``secret`` / ``password``."""
    receivers = []
    for index, receiver in enumerate(notify.receivers):
        for env_key, key in (("secret_env", "secret"), ("password_env", "password")):
            name = getattr(receiver, env_key)
            if not name:
                continue
            value = environ.get(name, "")
            if not value:
                raise ConfigError(
                    f"notify.receivers[{index}].{env_key}",
                    f"environment variable {name} is not set",
                )
            # The value replaces the variable's name: the resolved receiver has one of the two.
            resolved = {key: value, env_key: ""}
            receiver = msgspec.structs.replace(receiver, **resolved)  # noqa: PLW2901 - the resolved copy
        receivers.append(receiver)
    return msgspec.structs.replace(notify, receivers=receivers)


def notify_secrets(config: Config) -> list[str]:
    """The receivers' webhook secrets, SMTP passwords, header values and URL userinfo
    (never logged)."""
    return [s for r in config.notify.receivers for s in receiver_secrets(r)]


_PUBLIC_URL: Final = re.compile(r"^https?://[^/\s?#]+(/[^\s?#]*)?\Z")


def _validate_notify(config: Config) -> list[ConfigError]:
    errors: list[ConfigError] = []
    if config.http.public_url and _PUBLIC_URL.match(config.http.public_url) is None:
        errors.append(ConfigError("http.public_url", "must be http(s)://host[:port][/path]"))
    try:
        compile_notify(config.notify)  # ConfigError("notify.routes[i].receivers[j]", ...)
    except ConfigError as exc:
        errors.extend(_each(exc))
    return errors


def validate(config: Config) -> None:
    """Checks that cross keys or need more than a type: every failing one is reported (one
    :class:`ConfigErrors`), each with its key path."""
    errors: list[ConfigError] = []

    def check(key_path: str, ok: bool, message: str) -> None:
        if not ok:
            errors.append(ConfigError(key_path, message))

    check(
        "node.id",
        not config.node.id or is_valid_device_id(config.node.id),
        "must match ^[A-Za-z0-9_.:-]{1,64}$",
    )
    check(
        "node.id",
        not config.node.id
        or config.mqtt.broker_family not in _DOTTED
        or is_portable_device_id(config.node.id),
        f"must hold no `.` with [mqtt] broker_family = {config.mqtt.broker_family!r}",
    )
    try:
        topics: Topics | None = Topics(config.mqtt.topic_prefix)
    except ValueError as exc:
        topics = None
        errors.append(ConfigError("mqtt.topic_prefix", str(exc)))
    if config.mqtt.shared_group and topics is not None:
        try:
            topics.subscription(TopicKind.TELEMETRY, config.mqtt.shared_group)
        except ValueError as exc:
            errors.append(ConfigError("mqtt.shared_group", str(exc)))
    errors.extend(_endpoint_errors(config.mqtt))
    check(
        "http.host",
        not config.http.host or _is_host(config.http.host),
        "must be an address or a host name to listen on (0.0.0.0, ::, 127.0.0.1): not a URL,"
        " no port (that is [http] port), an IPv6 address without brackets",
    )
    check(
        "mqtt.reconnect_min_s",
        config.mqtt.reconnect_min_s <= config.mqtt.reconnect_max_s,
        "must not exceed mqtt.reconnect_max_s",
    )
    tls = config.mqtt.tls
    check(
        "mqtt.tls.key_file",
        (tls.cert_file == "") == (tls.key_file == ""),
        "cert_file and key_file go together",
    )
    check(
        "database.pool_min",
        config.database.pool_min <= config.database.pool_max,
        "must not exceed database.pool_max",
    )
    for index, token in enumerate(config.api.tokens):
        check(
            f"api.tokens[{index}]",
            bool(token.token) != bool(token.token_env),
            "set exactly one of token and token_env",
        )
        check(
            f"api.tokens[{index}].token",
            not token.token or len(token.token) >= TOKEN_MIN_LENGTH,
            f"must be at least {TOKEN_MIN_LENGTH} characters",
        )
    errors.extend(_token_name_errors(config.api.tokens))
    errors.extend(_duration_errors(config, ""))
    errors.extend(_validate_sparkplug(config.sparkplug, config.mqtt.broker_family))
    errors.extend(_rule_errors(config.rules))
    if topics is not None:
        try:
            compile_mappings(
                config.ingest.mappings,
                native_filters=native_filters(topics),
                portable_ids=config.mqtt.broker_family in _DOTTED,
            )
        except ConfigError as exc:
            errors.extend(_each(exc))
    errors.extend(_validate_ai(config.ai))
    errors.extend(_validate_notify(config))
    try:
        compile_quiet_hours(config.alarms.quiet_hours)  # ConfigError("alarms.quiet_hours...")
    except ConfigError as exc:
        errors.extend(_each(exc))
    check(
        "database.retry_min_s",
        config.database.retry_min_s <= config.database.retry_max_s,
        "must not exceed database.retry_max_s",
    )
    figures = config.alarms.figures
    check(
        "alarms.figures.chatter_lookback_s",
        figures.chatter_lookback_s >= figures.chatter_window_s,
        "must not be shorter than alarms.figures.chatter_window_s",
    )
    check(
        "alarms.figures.chatter_window_s",
        figures.chatter_window_s <= 86400,
        "at most 86400 (a day)",
    )
    check(
        "outbox.retry_min_s",
        config.outbox.retry_min_s <= config.outbox.retry_max_s,
        "must not exceed outbox.retry_max_s",
    )
    if errors:
        raise config_errors(errors)


# The longest duration a setting of seconds may hold: a century. Past what a date can hold
# (`inf`, TOML's infinity, passes `>= 0`), the first timer pass computing `now - timedelta(...)`
# raised OverflowError and ended the daemon, after a reload as at a start.
MAX_DURATION_S: Final = 100 * 365.25 * 86400


def _duration_errors(value: object, path: str) -> list[ConfigError]:
    """Every float setting of seconds (``*_s``, ``*_seconds``) anywhere in the tree, the
    sections' lists included: finite, and at most ``MAX_DURATION_S``."""
    errors: list[ConfigError] = []
    if isinstance(value, Struct):
        for name in value.__struct_fields__:
            item = getattr(value, name)
            at = f"{path}.{name}" if path else name
            if isinstance(item, float) and name.endswith(("_s", "_seconds")):
                if not item <= MAX_DURATION_S:  # inf; nan is refused by its type already
                    errors.append(
                        ConfigError(at, f"at most {MAX_DURATION_S:.0f} seconds (a century)")
                    )
            else:
                errors.extend(_duration_errors(item, at))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            errors.extend(_duration_errors(item, f"{path}[{index}]"))
    return errors


def _endpoint_errors(mqtt: MqttConfig) -> list[ConfigError]:
    """``[mqtt] host``: a host name or an address alone. ``[mqtt] hosts``: every entry
    host:port, none twice, and not beside ``host``."""
    errors: list[ConfigError] = []
    if mqtt.host and not _is_host(mqtt.host):
        # Never the value: a password written in a URL would be in the message.
        errors.append(
            ConfigError(
                "mqtt.host",
                "must be a host name or an IP address alone: not a URL (mqtt://...), no port"
                " (that is [mqtt] port), no user (that is [mqtt] username and password)",
            )
        )
    if mqtt.hosts and mqtt.host:
        errors.append(
            ConfigError(
                "mqtt.hosts",
                "set [mqtt] host or [mqtt] hosts, not both (hosts lists every endpoint,"
                " the one of host included)",
            )
        )
    seen: dict[tuple[str, int], int] = {}
    for index, entry in enumerate(mqtt.hosts):
        try:
            endpoint = parse_endpoint(entry, mqtt.port, f"mqtt.hosts[{index}]")
        except ConfigError as exc:
            errors.append(exc)
            continue
        if endpoint in seen:
            errors.append(
                ConfigError(f"mqtt.hosts[{index}]", f"{entry!r} is mqtt.hosts[{seen[endpoint]}]")
            )
        seen.setdefault(endpoint, index)
    return errors


def _is_host(text: str) -> bool:
    """A host name, an IPv4 address or an IPv6 one (without brackets, a zone allowed)."""
    if _HOST_NAME.match(text):
        return True
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


TOKEN_MIN_LENGTH: Final = 16
TOKEN_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9 _.@-]{0,63}$"  # noqa: S105 - a pattern
_TOKEN_NAME: Final = re.compile(TOKEN_NAME_PATTERN.removesuffix("$") + r"\Z")


def _token_name_errors(tokens: list[TokenConfig]) -> list[ConfigError]:
    """Every token has a name, unique: the audit trail records it as the actor."""
    errors: list[ConfigError] = []
    seen: dict[str, int] = {}
    for index, token in enumerate(tokens):
        path = f"api.tokens[{index}].name"
        if not token.name:
            errors.append(ConfigError(path, "required: the audit trail names the token by it"))
            continue
        if _TOKEN_NAME.match(token.name) is None:
            errors.append(
                ConfigError(
                    path,
                    "1 to 64 letters, digits, spaces and _ . @ - (starting with a letter or digit)",
                )
            )
        if token.name in seen:
            errors.append(
                ConfigError(
                    path, f"{token.name!r} is taken already by api.tokens[{seen[token.name]}]"
                )
            )
            continue
        seen[token.name] = index
    return errors


def _each(error: ConfigError) -> list[ConfigError]:
    return list(error.errors) if isinstance(error, ConfigErrors) else [error]


def _rule_errors(rules: list[RuleConfig]) -> list[ConfigError]:
    """Each rule's mistakes; then, if every rule compiles, those across rules (duplicates)."""
    errors: list[ConfigError] = []
    for index, rule in enumerate(rules):
        try:
            compile_rule(rule, f"rules[{index}]")
        except ConfigError as exc:
            errors.extend(_each(exc))
    if not errors:
        try:
            compile_rules(rules)
        except ConfigError as exc:
            errors.extend(_each(exc))
    return errors


def _is_http_url(url: str) -> bool:
    """Whether ``url`` is an absolute http(s) URL with a host (a port 0-65535 if it names
    one), no query or fragment (``/chat/completions`` is appended) and no ``@`` after the
    host (a password's ``/``: see ``userinfo_cut``): what the LLM client takes."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not 0-65535
    except ValueError:
        return False
    plain = "?" not in url and "#" not in url and not userinfo_cut(url)
    return parts.scheme in {"http", "https"} and bool(parts.hostname) and plain


def _validate_ai(ai: AiConfig) -> list[ConfigError]:
    errors: list[ConfigError] = []
    if ai.enabled:
        for key in ("base_url", "model"):
            if not getattr(ai, key):
                errors.append(ConfigError(f"ai.{key}", "required when ai.enabled is true"))
    if ai.enabled and ai.base_url and not _is_http_url(ai.base_url):
        # Accepted, it ended every start in a traceback quoting the URL: without its scheme
        # (`user:password@host/v1`) Python finds no userinfo, and the password was logged. A
        # query (`?key=...`) swallowed the path appended, and every error quoted the key.
        errors.append(
            ConfigError(
                "ai.base_url",
                "must be an http:// or https:// URL with a host, and no query or fragment"
                " (/chat/completions is appended to it); a '/', '?' or '#' in its user name"
                " or password written %2F, %3F, %23",
            )
        )
    if _CONTROL.search(ai.api_key):
        errors.append(
            ConfigError("ai.api_key", "holds a control character (an HTTP header cannot carry it)")
        )
    if ai.api_key and ai.api_key_env:
        errors.append(ConfigError("ai.api_key", "set at most one of api_key and api_key_env"))
    if (ai.api_key or ai.api_key_env) and url_credentials(ai.base_url):
        # The HTTP client sends the URL's credentials as Basic authentication, and refuses
        # them beside the key's Authorization header.
        errors.append(
            ConfigError("ai.base_url", "credentials in the URL exclude api_key and api_key_env")
        )
    if ai.processing_timeout_s <= ai.timeout_s:
        # The sweep takes a task PROCESSING this long as lost (WORKER_LOST, then the next
        # attempt): a call still allowed to run would be swept, its answer discarded.
        errors.append(
            ConfigError(
                "ai.processing_timeout_s",
                f"must exceed ai.timeout_s ({ai.timeout_s:g}): a call still running would be"
                " failed as WORKER_LOST",
            )
        )
    if ai.prompt_version not in PROMPTS:
        errors.append(
            ConfigError("ai.prompt_version", f"unknown prompt version; known: {sorted(PROMPTS)}")
        )
    return errors


def _validate_sparkplug(sparkplug: SparkplugConfig, broker_family: str) -> list[ConfigError]:
    errors: list[ConfigError] = []
    if sparkplug.enabled and not sparkplug.host_id:
        errors.append(ConfigError("sparkplug.host_id", "required when sparkplug.enabled is true"))
    dotted = broker_family in _DOTTED
    if sparkplug.host_id and not is_valid_device_id(sparkplug.host_id):
        errors.append(ConfigError("sparkplug.host_id", "must match ^[A-Za-z0-9_.:-]{1,64}$"))
    if sparkplug.enabled and dotted:
        errors.append(
            ConfigError(
                "sparkplug.enabled",
                f"Sparkplug's namespace `spBv1.0` holds a `.`, which [mqtt] broker_family = "
                f"{broker_family!r} maps to its own separator: use a broker that keeps it",
            )
        )
    seen: set[str] = set()
    for index, group in enumerate(sparkplug.groups):
        path = f"sparkplug.groups[{index}]"
        if not is_valid_device_id(group):
            errors.append(ConfigError(path, "must match ^[A-Za-z0-9_.:-]{1,64}$"))
        elif group in seen:
            errors.append(ConfigError(path, f"{group!r} is listed twice"))
        seen.add(group)
    return errors
