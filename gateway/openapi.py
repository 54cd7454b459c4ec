"""The OpenAPI 3.1 document served at ``/openapi.json`` (SPEC §9).

The alarm and request body schemas are generated from the msgspec structs the API encodes and
decodes, so they cannot drift from the code; the rest is written out here (the command and
receipt schemas describe table rows: a test compares them with what the API returns).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final

import msgspec

from gateway.api import (
    ACTOR_MAX_LENGTH,
    FILTER_MAX_LENGTH,
    LIMIT_DEFAULT,
    LIMIT_MAX,
    NOTE_MAX_LENGTH,
    PATH_ACTIONS,
    REQUEST_ID_HEADER,
    REQUEST_ID_MAX_LENGTH,
    ActionBody,
)
from gateway.command_api import (
    IDEMPOTENCY_KEY_MAX_LENGTH,
    NAME_MAX_LENGTH,
    PARAMS_MAX_BYTES,
    WAIT_MAX_S,
    CommandBody,
)
from gateway.domain.alarm import Alarm
from gateway.domain.command import TERMINAL_STATUSES, CommandStatus, RejectReason
from protocol import ReceiptResult

OPENAPI_VERSION: Final = "3.1.0"
_REF: Final = "#/components/schemas/{name}"


def _version() -> str:
    # Not gateway.app's helper: that module wires the daemon and will import the API.
    try:
        return version("mqtt-alarm-gateway")
    except PackageNotFoundError:
        return "0+unknown"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


def _response_ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/responses/{name}"}


def _struct_schemas() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [Alarm, ActionBody, CommandBody, CommandStatus], ref_template=_REF
    )
    alarm = components["Alarm"]
    alarm["description"] = (
        "An alarm (SPEC §5). Every field is always present; lifecycle steps not taken are null."
    )
    # Responses always carry every field (defaults are encoded too).
    alarm["required"] = list(alarm["properties"])
    for name, prop in alarm["properties"].items():
        if name.endswith("_at"):
            for option in prop.get("anyOf", [prop]):
                if option.get("type") == "string":
                    option["format"] = "date-time"
        prop.pop("default", None)
    # Only GET /alarms/{id} (and the action answers) carry it: not required.
    alarm["properties"]["ai_summary"] = {
        "anyOf": [_ref("AiSummary"), {"type": "null"}],
        "description": "The latest AI summary attempt (SPEC §8), null when there is none.",
    }
    components["AiSummary"] = {
        "type": "object",
        "description": "The outcome of the latest summary attempt; payloads are in /summaries.",
        "properties": {
            "status": {"enum": ["PENDING", "PROCESSING", "SUCCEEDED", "FAILED"]},
            "summary": {"type": ["string", "null"]},
            "possible_cause": {"type": ["string", "null"]},
            "inspection_suggestion": {"type": ["string", "null"]},
            "risk_level": {"enum": ["LOW", "MEDIUM", "HIGH", "CRITICAL", None]},
            "confidence": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "model_name": {"type": "string"},
            "prompt_version": {"type": "string"},
            "error_code": {"type": ["string", "null"]},
            "attempt": {"type": "integer", "minimum": 1},
            "finished_at": {"type": ["string", "null"], "format": "date-time"},
        },
        "required": ["status", "model_name", "prompt_version", "attempt"],
    }
    components["SummaryAttempts"] = {
        "type": "object",
        "description": (
            "Every summary attempt, oldest first; `request_payload` and `raw_response` are "
            "included for admin tokens only."
        ),
        "properties": {"items": {"type": "array", "items": {"type": "object"}}},
        "required": ["items"],
    }
    components["AlarmStatus"]["description"] = (
        "Open: NEW, PUSHED, DELAYED, CONFIRMED, ESCALATED. Terminal: CLOSED, FALSE, SUPERSEDED."
    )
    body = components["ActionBody"]
    body["example"] = {"actor": "alice", "note": "on my way"}
    command = components["CommandBody"]
    command["description"] = (
        "A downlink command for the device. `params` is any JSON object of at most "
        f"{PARAMS_MAX_BYTES} bytes (no U+0000 anywhere: PostgreSQL's jsonb cannot hold it)."
    )
    command["example"] = {
        "name": "reboot",
        "params": {"delay_s": 5},
        "delivery": "realtime",
        "idempotency_key": "ticket-4711-reboot",
    }
    components["Delivery"]["description"] = (
        "`realtime`: any failure is final (FAILED) and returned to a waiting caller at once. "
        "`deferrable`: DEVICE_OFFLINE, TIMEOUT and FAILED receipts requeue it (PENDING) with "
        "backoff, up to 10 times, then TIMEOUT."
    )
    terminal = ", ".join(s.value for s in CommandStatus if s in TERMINAL_STATUSES)
    components["CommandStatus"]["description"] = (
        f"Open: PENDING, CLAIMED, SENT. Terminal: {terminal}. ACKED means the device answered "
        "with resultCode 0 (its claim of success); any other code is FAILED."
    )
    return dict(components)


_PERSON_ACTION: Final = {
    "type": "string",
    "enum": [a.value for a in PATH_ACTIONS],
    "description": "A person's action.",
}

_ERROR_SCHEMA: Final = {
    "type": "object",
    "description": (
        "The one error shape: `error` is a stable code, `message` a sentence for people; "
        "the other properties are details that some codes carry."
    ),
    "required": ["error", "message"],
    "properties": {
        "error": {
            "type": "string",
            "description": "Stable error code.",
            "examples": [
                "BAD_REQUEST",
                "UNAUTHORIZED",
                "FORBIDDEN",
                "NOT_FOUND",
                "METHOD_NOT_ALLOWED",
                "INVALID_BODY",
                "INVALID_ACTOR",
                "ILLEGAL_TRANSITION",
                "ALARM_SUPERSEDED",
                "DEVICE_UNBOUND",
                "STATUS_CHANGED",
                "PAYLOAD_TOO_LARGE",
                "INTERNAL",
                "AUDIT_FAILED",
                "UNAVAILABLE",
            ],
        },
        "message": {"type": "string"},
        "param": {
            "type": "string",
            "description": "BAD_REQUEST: the parameter (or header) that was wrong.",
        },
        "detail": {"type": "string", "description": "INVALID_BODY: what does not fit, and where."},
        "alarm_id": {"type": "integer", "description": "NOT_FOUND: the unknown alarm id."},
        "command_id": {
            "type": "integer",
            "description": "NOT_FOUND, ILLEGAL_TRANSITION: the command asked about.",
        },
        "device_id": {"type": "string", "description": "DEVICE_UNBOUND: the unbound device."},
        "current_status": {
            "anyOf": [_ref("AlarmStatus"), _ref("CommandStatus")],
            "description": (
                "ILLEGAL_TRANSITION, STATUS_CHANGED: the alarm's (or the command's) status now."
            ),
        },
        "action": {"type": "string", "description": "ILLEGAL_TRANSITION: the refused action."},
        "allowed": {
            "type": "array",
            "items": {"type": "string"},
            "description": "ILLEGAL_TRANSITION: the actions allowed instead.",
        },
        "superseded_by": {
            **_nullable({"type": "integer"}),
            "description": "ALARM_SUPERSEDED: the alarm that replaced this one.",
        },
        "actor": {
            **_nullable({"type": "string"}),
            "description": "STATUS_CHANGED: who took the step first (`already confirmed by X`).",
        },
        "alarm": {**_ref("Alarm"), "description": "STATUS_CHANGED: the alarm as it is now."},
        "reason": {"type": "string", "description": "INVALID_ACTOR: why the actor is refused."},
        "required_role": {
            "type": "string",
            "enum": ["viewer", "operator", "admin"],
            "description": "FORBIDDEN: the role the operation needs.",
        },
    },
    "additionalProperties": True,
}

_TIME: Final = {"type": "string", "format": "date-time"}
_ID: Final = {"type": "integer", "format": "int64"}
_COMMAND_PROPERTIES: Final[dict[str, Any]] = {
    "id": _ID,
    "device_id": {"type": "string"},
    "name": {"type": "string"},
    "params": {"type": "object"},
    "delivery": _ref("Delivery"),
    "status": _ref("CommandStatus"),
    "idempotency_key": _nullable({"type": "string"}),
    "claim_generation": {
        "type": "integer",
        "description": "Bumped by every claim (never by a lease expiry); 0: never claimed.",
    },
    "claimed_node_id": _nullable({"type": "string"}),
    "claimed_at": _nullable(_TIME),
    "lease_expire_at": _nullable(_TIME),
    "sent_at": _nullable(_TIME),
    "timeout_at": _nullable(_TIME),
    "expire_at": {**_TIME, "description": "Past this, an open command becomes TIMEOUT."},
    "next_attempt_at": _TIME,
    "finished_at": {**_nullable(_TIME), "description": "Set exactly when terminal."},
    "retry_count": {
        "type": "integer",
        "description": "Device-side failures requeued (deferrable; more than 10: TIMEOUT).",
    },
    "reclaim_count": {
        "type": "integer",
        "description": "Leases that expired because a node went silent.",
    },
    "result": _nullable({"type": "string", "enum": [r.value for r in ReceiptResult]}),
    "result_code": {
        **_nullable({"type": "integer"}),
        "description": "The standard result code (0: the device claims success).",
    },
    "raw_result_code": {
        **_nullable({"type": "string"}),
        "description": "The device's own code, as it sent it.",
    },
    "raw_ack": _nullable({"type": "string"}),
    "created_at": _TIME,
    "updated_at": _TIME,
    "created_by": {
        **_nullable({"type": "string"}),
        "description": "`api:<token name>` for commands created over this API.",
    },
}
_RECEIPT_PROPERTIES: Final[dict[str, Any]] = {
    "id": _ID,
    "reported_command_id": _ID,
    "claim_generation": _nullable({"type": "integer"}),
    "node_id": _nullable({"type": "string"}),
    "result": {"type": "string", "enum": [r.value for r in ReceiptResult]},
    "result_code": _nullable({"type": "integer"}),
    "raw_result_code": _nullable({"type": "string"}),
    "raw_ack": _nullable({"type": "string"}),
    "outcome": {"type": "string", "enum": ["accepted", "duplicated", "rejected"]},
    "reason": {
        **_nullable({"type": "string", "enum": [r.value for r in RejectReason]}),
        "description": "Why a rejected receipt was not applied; null otherwise.",
    },
    "received_by": {"type": "string"},
    "received_at": _TIME,
}

_SCHEMAS: Final[dict[str, Any]] = {
    "Error": _ERROR_SCHEMA,
    "AlarmPage": {
        "type": "object",
        "required": ["items", "next_before"],
        "properties": {
            "items": {"type": "array", "items": _ref("Alarm")},
            "next_before": {
                **_nullable({"type": "integer"}),
                "description": "Pass as `before` for the next (older) page; null on the last.",
            },
        },
    },
    "AllowedActions": {
        "type": "object",
        "required": ["status", "actions"],
        "properties": {
            "status": _ref("AlarmStatus"),
            "actions": {
                "type": "array",
                "items": _PERSON_ACTION,
                "description": "People's actions allowed now; render buttons from this.",
            },
            "superseded_by": {
                **_nullable({"type": "integer"}),
                "description": "Only for a SUPERSEDED alarm (whose actions are always empty).",
            },
        },
    },
    "Chain": {
        "type": "object",
        "required": ["items", "hint"],
        "properties": {
            "items": {
                "type": "array",
                "items": _ref("Alarm"),
                "description": (
                    "Oldest first: the alarm and every alarm it superseded, directly or not. "
                    "A superseded alarm's chain is itself alone."
                ),
            },
            "hint": {
                **_nullable({"type": "string"}),
                "description": "For a superseded alarm: `superseded by N, cannot be handled "
                "on its own`; null otherwise.",
            },
            "superseded_by": {
                **_nullable({"type": "integer"}),
                "description": "Only for a SUPERSEDED alarm.",
            },
        },
    },
    "AuditEntry": {
        "type": "object",
        "required": ["id", "actor", "action", "from_status", "to_status", "node_id", "at"],
        "properties": {
            "id": {"type": "integer"},
            "actor": {"type": "string", "description": "A person, or `system:<what>`."},
            "action": {"type": "string", "description": "`create`, or an action name."},
            "from_status": _nullable(_ref("AlarmStatus")),
            "to_status": _ref("AlarmStatus"),
            "note": _nullable({"type": "string"}),
            "request_id": _nullable({"type": "string"}),
            "event_id": _nullable({"type": "string"}),
            "node_id": {"type": "string"},
            "at": {"type": "string", "format": "date-time"},
        },
    },
    "AuditTrail": {
        "type": "object",
        "required": ["items"],
        "properties": {"items": {"type": "array", "items": _ref("AuditEntry")}},
        "description": "Every change of the alarm, oldest first.",
    },
    "Command": {
        "type": "object",
        "description": (
            "A downlink command (SPEC §7): every column, always present; steps not taken are "
            "null. `result`, `result_code`, `raw_result_code` and `raw_ack` come from the "
            "receipt that decided the outcome."
        ),
        "required": list(_COMMAND_PROPERTIES),
        "properties": _COMMAND_PROPERTIES,
    },
    "Receipt": {
        "type": "object",
        "description": (
            "A device's receipt as it came (SPEC §7), kept whatever its outcome; `node_id` and "
            "`claim_generation` are what the device reported, `received_by` the node that "
            "judged it."
        ),
        "required": list(_RECEIPT_PROPERTIES),
        "properties": _RECEIPT_PROPERTIES,
    },
    "CommandCreated": {
        "type": "object",
        "required": ["command", "created"],
        "properties": {
            "command": _ref("Command"),
            "created": {
                "type": "boolean",
                "description": "False when the idempotency key named an existing command.",
            },
        },
    },
    "CommandDetail": {
        "type": "object",
        "required": ["command", "receipts"],
        "properties": {
            "command": _ref("Command"),
            "receipts": {
                "type": "array",
                "items": _ref("Receipt"),
                "description": "Every receipt for the command, oldest first.",
            },
        },
    },
    "CommandPage": {
        "type": "object",
        "required": ["items", "next_before"],
        "properties": {
            "items": {"type": "array", "items": _ref("Command")},
            "next_before": {
                **_nullable({"type": "integer"}),
                "description": "Pass as `before` for the next (older) page; null on the last.",
            },
        },
    },
    "Unbound": {
        "type": "object",
        "required": ["device_id", "cancelled"],
        "properties": {
            "device_id": {"type": "string"},
            "cancelled": {
                "type": "array",
                "items": {"type": "integer"},
                "description": "The ids of the open commands this unbinding cancelled.",
            },
        },
    },
    "Health": {
        "type": "object",
        "required": ["status", "node_id", "version"],
        "properties": {
            "status": {"type": "string", "enum": ["ok", "unhealthy"]},
            "node_id": {"type": "string"},
            "version": {"type": "string"},
            "database": {"type": "object"},
            "broker": {"type": "object"},
        },
        "additionalProperties": True,
    },
}

_PARAMETERS: Final[dict[str, Any]] = {
    "AlarmId": {
        "name": "id",
        "in": "path",
        "required": True,
        "description": "Alarm id (anything but a positive integer is a 400).",
        "schema": {"type": "integer", "format": "int64", "minimum": 1},
    },
    "CommandId": {
        "name": "id",
        "in": "path",
        "required": True,
        "description": "Command id (anything but a positive integer is a 400).",
        "schema": {"type": "integer", "format": "int64", "minimum": 1},
    },
    "DeviceId": {
        "name": "id",
        "in": "path",
        "required": True,
        "description": "Device id (anything else is a 400).",
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,64}$"},
    },
    "RequestId": {
        "name": REQUEST_ID_HEADER,
        "in": "header",
        "required": False,
        "description": (
            "Recorded with the change in the audit trail and echoed in the response; "
            "a UUID is generated when absent."
        ),
        "schema": {
            "type": "string",
            "minLength": 1,
            "maxLength": REQUEST_ID_MAX_LENGTH,
            "pattern": "^[!-~]+$",
        },
    },
}

_RESPONSES: Final[dict[str, Any]] = {
    "BadRequest": _error("A parameter is wrong (`BAD_REQUEST`, with `param`)."),
    "Unauthorized": {
        **_error("No bearer token, or an unknown one (`UNAUTHORIZED`)."),
        "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
    },
    "Forbidden": _error("The token's role is too weak (`FORBIDDEN`)."),
    "NotFound": _error("No such alarm (`NOT_FOUND`)."),
    "CommandNotFound": _error("No such command (`NOT_FOUND`, with `command_id`)."),
    "Unavailable": _error("The database is not reachable (`UNAVAILABLE`); retry."),
    "Internal": _error(
        "A server fault (`INTERNAL`), logged as `api_error`; or a change whose audit row "
        "PostgreSQL refused (`AUDIT_FAILED`): it was rolled back, nothing changed."
    ),
}

_ECHOED_REQUEST_ID: Final = {
    REQUEST_ID_HEADER: {
        "description": "The request's id (given or generated).",
        "schema": {"type": "string"},
    }
}


def _guarded(
    summary: str, role: str, ok: dict[str, Any], extra: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """An operation behind a bearer token: the errors every one of them can answer."""
    responses = {
        "200": {**ok, "headers": _ECHOED_REQUEST_ID},
        **extra,
        "401": _response_ref("Unauthorized"),
        "403": _response_ref("Forbidden"),
        "500": _response_ref("Internal"),
        "503": _response_ref("Unavailable"),
    }
    return {
        "summary": summary,
        "security": [{"bearerAuth": []}],
        "x-required-role": role,
        "responses": dict(sorted(responses.items())),
        **fields,
    }


def _alarm_get(summary: str, operation_id: str, ok: dict[str, Any]) -> dict[str, Any]:
    return {
        "parameters": [_param_ref("AlarmId"), _param_ref("RequestId")],
        "get": _guarded(
            summary,
            "viewer",
            ok,
            {"400": _response_ref("BadRequest"), "404": _response_ref("NotFound")},
            operationId=operation_id,
            tags=["alarms"],
        ),
    }


def _param_ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/parameters/{name}"}


def _action_path(action: str) -> dict[str, Any]:
    ok = _json(_ref("Alarm"), f"The alarm after `{action}`.")
    refused = {
        "400": _error(
            "Bad id or header (`BAD_REQUEST`); the whitelist has no such step from the "
            "current status (`ILLEGAL_TRANSITION`, with `current_status` and `allowed`); or "
            "the alarm was superseded (`ALARM_SUPERSEDED`, with `superseded_by`). "
            "Nothing is changed."
        ),
        "404": _response_ref("NotFound"),
        "409": _error(
            "Someone changed the alarm first (`STATUS_CHANGED`, with `current_status` and "
            "`actor`: `already confirmed by X`). Nothing is changed."
        ),
        "413": _error("The body is too large (`PAYLOAD_TOO_LARGE`)."),
        "422": _error(
            "The body is not JSON, not an object, misses `actor`, has unknown fields or "
            "values out of bounds (`INVALID_BODY`, with `detail`); or the actor is reserved "
            "(`INVALID_ACTOR`)."
        ),
    }
    return {
        "parameters": [_param_ref("AlarmId"), _param_ref("RequestId")],
        "post": _guarded(
            f"{action.capitalize()} the alarm (a person's action)",
            "operator",
            ok,
            refused,
            operationId=f"{action}Alarm",
            tags=["alarms"],
            description=(
                "Conditional on the status the gateway read: of concurrent requests exactly "
                "one wins, the others get 409. The change, its audit row and its event commit "
                "together or not at all."
            ),
            requestBody={
                "required": True,
                "content": {"application/json": {"schema": _ref("ActionBody")}},
            },
        ),
    }


def _list_parameters() -> list[dict[str, Any]]:
    return [
        _param_ref("RequestId"),
        {
            "name": "status",
            "in": "query",
            "description": "Only these statuses (repeat the parameter for several).",
            "schema": {"type": "array", "items": _ref("AlarmStatus")},
            "style": "form",
            "explode": True,
        },
        {
            "name": "device",
            "in": "query",
            "description": "Only this device.",
            "schema": {"type": "string", "minLength": 1, "maxLength": FILTER_MAX_LENGTH},
        },
        {
            "name": "rule",
            "in": "query",
            "description": "Only this rule key.",
            "schema": {"type": "string", "minLength": 1, "maxLength": FILTER_MAX_LENGTH},
        },
        {
            "name": "open",
            "in": "query",
            "description": "Only open alarms (NEW, PUSHED, DELAYED, CONFIRMED, ESCALATED).",
            "schema": {"type": "boolean", "default": False},
        },
        *_page_parameters("alarms"),
    ]


def _page_parameters(what: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "limit",
            "in": "query",
            "description": "Page size.",
            "schema": {
                "type": "integer",
                "minimum": 1,
                "maximum": LIMIT_MAX,
                "default": LIMIT_DEFAULT,
            },
        },
        {
            "name": "before",
            "in": "query",
            "description": f"Keyset cursor: only {what} with a smaller id (`next_before`).",
            "schema": {"type": "integer", "format": "int64", "minimum": 1},
        },
    ]


def _paths(*, commands: bool) -> dict[str, Any]:
    open_op: dict[str, Any] = {"security": [], "tags": ["service"]}
    paths: dict[str, Any] = {
        "/health": {
            "get": {
                **open_op,
                "operationId": "health",
                "summary": "Node health: database, broker, backlog, node id, version",
                "responses": {
                    "200": _json(_ref("Health"), "Healthy."),
                    "503": _json(_ref("Health"), "Not healthy; the body says what is wrong."),
                },
            }
        },
        "/metrics": {
            "get": {
                **open_op,
                "operationId": "metrics",
                "summary": "Prometheus metrics (`gateway_` prefix)",
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition format.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                **open_op,
                "operationId": "openapi",
                "summary": "This document",
                "responses": {"200": _json({"type": "object"}, "The OpenAPI document.")},
            }
        },
        "/alarms": {
            "get": _guarded(
                "List alarms, newest first (keyset pagination by id)",
                "viewer",
                _json(_ref("AlarmPage"), "One page."),
                {"400": _response_ref("BadRequest")},
                operationId="listAlarms",
                tags=["alarms"],
                parameters=_list_parameters(),
            )
        },
        "/alarms/{id}": _alarm_get("One alarm", "getAlarm", _json(_ref("Alarm"), "The alarm.")),
        "/alarms/{id}/actions": _alarm_get(
            "The people's actions allowed now (render buttons from this, never guess)",
            "getAlarmActions",
            _json(_ref("AllowedActions"), "Current status and allowed actions."),
        ),
        "/alarms/{id}/chain": _alarm_get(
            "The supersede chain that ends at this alarm",
            "getAlarmChain",
            _json(_ref("Chain"), "The chain, oldest first."),
        ),
        "/alarms/{id}/audit": _alarm_get(
            "The audit trail of the alarm",
            "getAlarmAudit",
            _json(_ref("AuditTrail"), "Every change, oldest first."),
        ),
        "/alarms/{id}/summaries": _alarm_get(
            "Every AI summary attempt of the alarm (payloads for admins)",
            "getAlarmSummaries",
            _json(_ref("SummaryAttempts"), "The attempts, oldest first."),
        ),
    }
    for action in PATH_ACTIONS:
        paths[f"/alarms/{{id}}/{action.value}"] = _action_path(action.value)
    if commands:
        paths.update(_command_paths())
    return paths


def _command_paths() -> dict[str, Any]:
    created = _json(_ref("CommandCreated"), "Created (PENDING, or as it was when the wait ended).")
    existing = _json(
        _ref("CommandCreated"),
        "The idempotency key named an existing command of this device: that command "
        "(`created` false), whatever this request's name and params.",
    )
    bad_device = {"400": _error("Bad device id, parameter or header (`BAD_REQUEST`).")}
    tags = ["commands"]
    return {
        "/devices/{id}/commands": {
            "parameters": [_param_ref("DeviceId"), _param_ref("RequestId")],
            "post": _guarded(
                "Send a command to the device, optionally waiting for its outcome",
                "operator",
                existing,
                {
                    "201": {**created, "headers": _ECHOED_REQUEST_ID},
                    **bad_device,
                    "409": _error(
                        "The device is unbound (`DEVICE_UNBOUND`, with `device_id`); "
                        "nothing is created."
                    ),
                    "413": _error("The body is too large (`PAYLOAD_TOO_LARGE`)."),
                    "422": _error(
                        "The body is not JSON, not an object, misses `name`, has unknown "
                        "fields or values out of bounds (`INVALID_BODY`, with `detail`)."
                    ),
                },
                operationId="createCommand",
                tags=tags,
                description=(
                    "The command is created PENDING, attributed to `api:<token name>`; any "
                    "node's dispatcher claims and publishes it. With `wait`, the call returns "
                    "once the command is terminal (ACKED, FAILED, TIMEOUT, CANCELLED) or the "
                    "wait is over, with the command as it is then: a realtime command's failure "
                    "comes back in this call. The gateway reads the command a few times a "
                    "second while waiting (no connection is held in between); the status code "
                    "is 201 or 200 whatever the outcome, which is in `command.status`."
                ),
                parameters=[
                    {
                        "name": "wait",
                        "in": "query",
                        "description": (
                            "Seconds to wait for a terminal status (a plain decimal, 0 to "
                            f"{WAIT_MAX_S:g}). Without it the call returns at once."
                        ),
                        "schema": {"type": "number", "minimum": 0, "maximum": WAIT_MAX_S},
                    }
                ],
                requestBody={
                    "required": True,
                    "content": {"application/json": {"schema": _ref("CommandBody")}},
                },
            ),
            "get": _guarded(
                "The device's commands, newest first (keyset pagination by id)",
                "viewer",
                _json(_ref("CommandPage"), "One page."),
                bad_device,
                operationId="listDeviceCommands",
                tags=tags,
                parameters=_page_parameters("commands"),
            ),
        },
        "/devices/{id}/unbind": {
            "parameters": [_param_ref("DeviceId"), _param_ref("RequestId")],
            "post": _guarded(
                "Unbind the device: it takes no more commands; its open ones are cancelled",
                "operator",
                _json(_ref("Unbound"), "Unbound (again, if it was already)."),
                bad_device,
                operationId="unbindDevice",
                tags=tags,
                description=(
                    "Later `POST /devices/{id}/commands` get 409 `DEVICE_UNBOUND`. A device "
                    "never seen is registered as unbound. No request body."
                ),
            ),
        },
        "/commands/{id}": {
            "parameters": [_param_ref("CommandId"), _param_ref("RequestId")],
            "get": _guarded(
                "One command with its receipts",
                "viewer",
                _json(_ref("CommandDetail"), "The command and every receipt for it."),
                {
                    "400": _response_ref("BadRequest"),
                    "404": _response_ref("CommandNotFound"),
                },
                operationId="getCommand",
                tags=tags,
            ),
        },
        "/commands/{id}/cancel": {
            "parameters": [_param_ref("CommandId"), _param_ref("RequestId")],
            "post": _guarded(
                "Cancel the command (PENDING, CLAIMED or SENT → CANCELLED)",
                "operator",
                _json(_ref("Command"), "The command, CANCELLED."),
                {
                    "400": _error(
                        "Bad id or header (`BAD_REQUEST`); or the command is terminal "
                        "already (`ILLEGAL_TRANSITION`, with `current_status`). Nothing is "
                        "changed."
                    ),
                    "404": _response_ref("CommandNotFound"),
                },
                operationId="cancelCommand",
                tags=tags,
                description=(
                    "A conditional write: of concurrent cancels exactly one wins. A command "
                    "already published may still run on the device. No request body."
                ),
            ),
        },
    }


def openapi_document(*, commands: bool = False) -> dict[str, Any]:
    """The whole document, built afresh (callers encode it once).

    It describes exactly the routes mounted: the command paths only with ``commands``
    (:func:`gateway.command_api.add_command_api` serves that one). The shared components
    (schemas, errors) are always all there.
    """
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "MQTT alarm & command gateway: operator API",
            "version": _version(),
            "description": (
                "Bearer tokens from the configuration carry a role: `viewer` may read, "
                "`operator` may also act on alarms and send commands, `admin` may do everything. "
                f"Every error has one shape (`Error`). Actors are at most {ACTOR_MAX_LENGTH} "
                f"characters, notes at most {NOTE_MAX_LENGTH}; command names at most "
                f"{NAME_MAX_LENGTH}, idempotency keys at most {IDEMPOTENCY_KEY_MAX_LENGTH}."
            ),
        },
        "tags": [
            {"name": "alarms", "description": "Alarm lifecycle (SPEC §5)."},
            {"name": "commands", "description": "Downlink commands (SPEC §7)."},
            {"name": "service", "description": "Health, metrics, this document."},
        ],
        "paths": _paths(commands=commands),
        "components": {
            "schemas": {**_struct_schemas(), **_SCHEMAS},
            "parameters": _PARAMETERS,
            "responses": _RESPONSES,
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A token from `[[api.tokens]]` in the configuration.",
                }
            },
        },
    }
