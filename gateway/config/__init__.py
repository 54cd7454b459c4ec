"""Configuration: one TOML file decoded into a tree of frozen msgspec structs.

Unknown keys and wrong types are errors naming the key path. Secrets (database DSN, MQTT
credentials) may come from the environment or from systemd credentials instead of the file.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta, Struct, field

from gateway.domain.ai_prompt import PROMPTS
from gateway.domain.errors import ConfigError
from gateway.domain.quiet_hours import QuietHours, QuietHoursConfig, compile_quiet_hours
from gateway.domain.rules import RuleConfig, RuleSet, compile_rules
from protocol import TopicKind, Topics, is_valid_device_id

Port = Annotated[int, Meta(ge=1, le=65535)]
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
    topic_prefix: str = "iot"
    client_id: str = ""
    username: str = ""
    password: str = ""
    tls: TlsConfig = field(default_factory=TlsConfig)
    protocol: Literal["3.1.1", "5"] = "5"
    shared_group: str = ""
    keepalive_s: PositiveInt = 30
    session_expiry_s: Annotated[int, Meta(ge=0, le=4294967295)] = 86400
    receive_maximum: Annotated[int, Meta(ge=1, le=65535)] = 1000
    broker_inflight: PositiveInt = 20
    encoding: Literal["json", "msgpack"] = "json"
    max_payload_bytes: PositiveInt = 65536
    reconnect_min_s: PositiveFloat = 0.5
    reconnect_max_s: PositiveFloat = 30.0


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
    queue_max: PositiveInt = 2000
    read_buffer: Annotated[int, Meta(ge=2)] = 1000
    read_buffer_bytes: Annotated[int, Meta(ge=2)] = 16 * 1024 * 1024
    drain_timeout_s: PositiveFloat = 20.0
    refused_batch_attempts: PositiveInt = 5
    dead_letter_max_bytes: Annotated[int, Meta(ge=0)] = 65536


class HttpConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080  # 0: any free port


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


class AlarmsConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    escalate_after_s: Annotated[float, Meta(ge=0)] = 0.0
    repeat_interval_s: Annotated[float, Meta(ge=0)] = 0.0
    timer_interval_s: PositiveFloat = 5.0
    quiet_hours: QuietHoursConfig = field(default_factory=QuietHoursConfig)


class CommandsConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    lease_s: PositiveFloat = 30.0
    ack_window_s: Annotated[float, Meta(ge=0)] = 30.0
    sent_timeout_s: PositiveFloat = 86400.0
    expire_after_s: PositiveFloat = 259200.0
    max_in_flight_per_device: PositiveInt = 1
    dispatch_batch: PositiveInt = 100
    reaper_interval_s: PositiveFloat = 5.0


class AiConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = False
    base_url: str = ""
    model: str = ""
    api_key_env: str = ""
    prompt_version: str = "v1"
    timeout_s: PositiveFloat = 30.0
    max_attempts: PositiveInt = 3
    workers: PositiveInt = 2
    json_mode: bool = True
    processing_timeout_s: PositiveFloat = 300.0


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
    ai: AiConfig = field(default_factory=AiConfig)

    @property
    def node_id(self) -> str:
        return self.node.id or default_node_id()

    @property
    def state_dir(self) -> Path:
        if self.node.state_dir:
            return Path(self.node.state_dir)
        # systemd's StateDirectory= exports the path; otherwise stay next to the caller.
        return Path(os.environ.get("STATE_DIRECTORY", ".gateway-state")).resolve()

    def rule_set(self) -> RuleSet:
        return compile_rules(self.rules)

    def quiet_hours(self) -> QuietHours | None:
        if not self.alarms.quiet_hours.windows:
            return None
        return compile_quiet_hours(self.alarms.quiet_hours)

    @property
    def topics(self) -> Topics:
        return Topics(self.mqtt.topic_prefix)

    def batch_size(self, protocol: str) -> int:
        """Messages per transaction: at most half the broker's window of unacked messages.

        The broker stops sending once that window is full of messages we have not acked
        yet, so a batch larger than the window would never fill; half lets the next batch
        fill while the previous one commits. ``protocol`` is the one actually spoken (the
        embedded broker speaks 3.1.1 whatever the file says).
        """
        window = self.mqtt.receive_maximum if protocol == "5" else self.mqtt.broker_inflight
        return max(1, min(self.ingest.batch_max, window // 2))


def default_node_id() -> str:
    name = re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname())[:64]
    return name or "gateway"


_AT_PATH: Final = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_FIELD: Final = re.compile(r"(?:unknown|required) field `(?P<field>[^`]+)`")


def _key_path(error: msgspec.ValidationError) -> ConfigError:
    match = _AT_PATH.match(str(error))
    assert match is not None  # the pattern matches any string
    message = match.group("message")
    path = (match.group("path") or "").lstrip(".")
    field_match = _FIELD.search(message)
    if field_match:
        path = f"{path}.{field_match.group('field')}" if path else field_match.group("field")
    return ConfigError(path or "<root>", message)


def parse_config(text: str | bytes) -> Config:
    try:
        config = msgspec.toml.decode(text, type=Config)
    except msgspec.ValidationError as exc:
        raise _key_path(exc) from exc
    except msgspec.DecodeError as exc:
        raise ConfigError("<toml>", str(exc)) from exc
    validate(config)
    return config


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

    def secret(env_name: str, credential: str | None, current: str) -> str:
        if environ.get(env_name):
            return environ[env_name]
        if credentials and credential:
            candidate = Path(credentials) / credential
            if candidate.is_file():
                return candidate.read_text(encoding="utf-8").strip()
        return current

    database = msgspec.structs.replace(
        config.database,
        dsn=secret(ENV_DATABASE_DSN, CREDENTIAL_DATABASE_DSN, config.database.dsn),
    )
    mqtt = msgspec.structs.replace(
        config.mqtt,
        username=secret(ENV_MQTT_USERNAME, None, config.mqtt.username),
        password=secret(ENV_MQTT_PASSWORD, CREDENTIAL_MQTT_PASSWORD, config.mqtt.password),
    )
    tokens = []
    for index, entry in enumerate(config.api.tokens):
        if entry.token_env:
            value = environ.get(entry.token_env, "")
            if not value:
                raise ConfigError(
                    f"api.tokens[{index}].token_env",
                    f"environment variable {entry.token_env} is not set",
                )
            entry = msgspec.structs.replace(entry, token=value)  # noqa: PLW2901 - the resolved copy
        tokens.append(entry)
    api = msgspec.structs.replace(config.api, tokens=tokens)
    return msgspec.structs.replace(config, database=database, mqtt=mqtt, api=api)


def validate(config: Config) -> None:
    """Checks that cross keys or need more than a type (raised with the key path)."""
    if config.node.id and not is_valid_device_id(config.node.id):
        raise ConfigError("node.id", "must match ^[A-Za-z0-9_.:-]{1,64}$")
    try:
        topics = Topics(config.mqtt.topic_prefix)
    except ValueError as exc:
        raise ConfigError("mqtt.topic_prefix", str(exc)) from exc
    if config.mqtt.shared_group:
        try:
            topics.subscription(TopicKind.TELEMETRY, config.mqtt.shared_group)
        except ValueError as exc:
            raise ConfigError("mqtt.shared_group", str(exc)) from exc
    if config.mqtt.reconnect_min_s > config.mqtt.reconnect_max_s:
        raise ConfigError("mqtt.reconnect_min_s", "must not exceed mqtt.reconnect_max_s")
    tls = config.mqtt.tls
    if (tls.cert_file == "") != (tls.key_file == ""):
        raise ConfigError("mqtt.tls.key_file", "cert_file and key_file go together")
    if config.database.pool_min > config.database.pool_max:
        raise ConfigError("database.pool_min", "must not exceed database.pool_max")
    for index, token in enumerate(config.api.tokens):
        if bool(token.token) == bool(token.token_env):
            raise ConfigError(f"api.tokens[{index}]", "set exactly one of token and token_env")
        if token.token and len(token.token) < 16:
            raise ConfigError(f"api.tokens[{index}].token", "must be at least 16 characters")
    _validate_token_names(config.api.tokens)
    compile_rules(config.rules)  # raises ConfigError("rules[i].field", ...)
    _validate_ai(config.ai)
    compile_quiet_hours(config.alarms.quiet_hours)  # ConfigError("alarms.quiet_hours...")
    if config.database.retry_min_s > config.database.retry_max_s:
        raise ConfigError("database.retry_min_s", "must not exceed database.retry_max_s")


TOKEN_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9 _.@-]{0,63}$"  # noqa: S105 - a pattern
_TOKEN_NAME: Final = re.compile(TOKEN_NAME_PATTERN.removesuffix("$") + r"\Z")


def _validate_token_names(tokens: list[TokenConfig]) -> None:
    """Every token has a name, unique: the audit trail records it as the actor."""
    seen: dict[str, int] = {}
    for index, token in enumerate(tokens):
        path = f"api.tokens[{index}].name"
        if not token.name:
            raise ConfigError(path, "required: the audit trail names the token by it")
        if _TOKEN_NAME.match(token.name) is None:
            raise ConfigError(
                path,
                "1 to 64 letters, digits, spaces and _ . @ - (starting with a letter or digit)",
            )
        if token.name in seen:
            raise ConfigError(
                path, f"{token.name!r} is taken already by api.tokens[{seen[token.name]}]"
            )
        seen[token.name] = index


def _validate_ai(ai: AiConfig) -> None:
    if ai.enabled:
        for key in ("base_url", "model"):
            if not getattr(ai, key):
                raise ConfigError(f"ai.{key}", "required when ai.enabled is true")
    if ai.prompt_version not in PROMPTS:
        raise ConfigError("ai.prompt_version", f"unknown prompt version; known: {sorted(PROMPTS)}")
