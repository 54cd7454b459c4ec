"""The served OpenAPI document against the running code (it is generated; these pin that the
generation covers everything): every route the app serves is in it, every documented status is
one its route declared, refs resolve, the docs page needs nothing from the internet; and what
the document says of values holds when they are sent: no union a valid value fails (an integer is
a number too), no query parameter takes `null`, and OPTIONS names every method a path serves."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import pytest
from litestar.routes import HTTPRoute

from gateway.api.console_route import ASSETS_PATH, INDEX_PATH
from gateway.api.errors import ErrorKind
from gateway.config import TokenConfig
from tests.support.api_client import ADMIN, OPERATOR, VIEWER, ApiClient
from tests.support.api_server import Served, serve_api

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="console"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]
DOCS = "/docs"
METHODS = ("get", "post", "put", "patch", "delete")
# A value for each path parameter: the routes check the parameters before any lookup, so these
# need not exist.
PATH_VALUES = {"integer": "1", "string": "dev-0"}


@pytest.fixture
async def served(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[tuple[Served, ApiClient]]:
    async with serve_api(db_dsn, TOKENS) as api, aiohttp.ClientSession() as http:
        yield api, ApiClient(base=api.base, http=http)


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def _served_operations(api: Served) -> dict[tuple[str, str], Any]:
    found = {}
    for route in api.app.routes:
        if not isinstance(route, HTTPRoute) or route.path.startswith(DOCS):
            continue
        if route.path == INDEX_PATH or route.path.startswith(ASSETS_PATH):
            continue  # the console's files, not operations
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
        for method, (handler, _) in route.route_handler_map.items():
            if method not in {"HEAD", "OPTIONS"}:
                found[(path, method.lower())] = handler
    return found


async def test_the_document_describes_exactly_what_is_served(
    served: tuple[Served, ApiClient],
) -> None:
    api, client = served
    reply = await client.call("GET", "/openapi.json", token=None)
    assert reply.status == 200
    document = reply.body
    assert document["openapi"].startswith("3.1")
    operations = _served_operations(api)
    described = {
        (path, method)
        for path, item in document["paths"].items()
        for method in item
        if method in METHODS
    }
    assert set(operations) == described
    assert {("/health", "get"), ("/metrics", "get"), ("/openapi.json", "get")} <= described
    for ref in _refs(document):
        node: Any = document
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
        assert node, ref

    for (path, method), handler in operations.items():
        operation = document["paths"][path][method]
        declared: frozenset[ErrorKind] = handler.opt["errors"]
        errors = {str(k.status) for k in declared}
        # Every response in the error shape is a declared error kind; the others are answers.
        shaped = {
            status for status, response in operation["responses"].items()
            if "ErrorBody" in str(response.get("content"))
        }  # fmt: skip
        assert shaped == errors, (path, method)
        for status, response in operation["responses"].items():
            for kind in declared:
                if str(kind.status) == status:
                    assert f"`{kind.code}`" in response["description"], (path, method, kind)
        role = handler.opt["role"]
        if role is None:
            assert "security" not in operation, (path, method)
            continue
        assert operation["security"] == [{"bearerAuth": [role.label]}], (path, method)
        assert {"401", "400", "500", "503"} <= set(operation["responses"]), (path, method)
        assert ("403" in operation["responses"]) == (role.label != "viewer"), (path, method)
        if "requestBody" in operation:
            assert {"413", "422"} <= set(operation["responses"]), (path, method)
            body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            name = body.rsplit("/", 1)[1]
            assert document["components"]["schemas"][name]["additionalProperties"] is False


async def test_the_docs_page_is_served_without_a_cdn(served: tuple[Served, ApiClient]) -> None:
    _, client = served
    async with client.http.get(f"{client.base}{DOCS}") as response:
        assert response.status == 200
        page = await response.text()
    sources = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page)
    assert sources
    for source in sources:
        assert source.startswith(f"{DOCS}/assets/"), source
        async with client.http.get(f"{client.base}{source}") as asset:
            assert asset.status == 200, source


async def test_the_stream_is_documented_as_an_event_stream(
    served: tuple[Served, ApiClient],
) -> None:
    _, client = served
    document = (await client.call("GET", "/openapi.json", token=None)).body
    stream = document["paths"]["/stream"]["get"]
    assert list(stream["responses"]["200"]["content"]) == ["text/event-stream"]
    assert {(p["name"], p["in"]) for p in stream["parameters"]} == {
        ("ticket", "query"), ("last_event_id", "query"), ("Last-Event-ID", "header"),
    }  # fmt: skip
    assert "security" not in stream  # a ticket or the usual header: the handler checks
    tickets = document["paths"]["/stream/tickets"]["post"]
    assert tickets["security"] == [{"bearerAuth": ["viewer"]}]
    assert "201" in tickets["responses"]
    assert document["paths"]["/me"]["get"]["security"] == [{"bearerAuth": ["viewer"]}]
    for path in ("/dead-letters", "/dead-letters/{id}/replay"):
        (operation,) = document["paths"][path].values()
        assert operation["security"] == [{"bearerAuth": ["admin"]}], path


def _resolve(schema: Any, document: Any) -> Any:
    while isinstance(schema, dict) and "$ref" in schema:
        node = document
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _schemas(node: Any) -> list[Any]:
    """Every schema object in the document (anything with a `type`, a union or a `$ref`)."""
    found = []
    if isinstance(node, dict):
        if any(key in node for key in ("type", "oneOf", "anyOf", "$ref")):
            found.append(node)
        found += [s for value in node.values() for s in _schemas(value)]
    elif isinstance(node, list):
        found += [s for value in node for s in _schemas(value)]
    return found


def _json_types(schema: Any, document: Any) -> set[str]:
    """The JSON types a schema admits, `integer` counted as `number` (every integer is one);
    `any` when the schema does not say."""
    schema = _resolve(schema, document)
    branches = schema.get("oneOf") or schema.get("anyOf")
    if "type" not in schema and branches:
        return {t for branch in branches for t in _json_types(branch, document)}
    kind = schema.get("type")
    if kind is None:
        return {"any"}
    kinds = {kind} if isinstance(kind, str) else set(kind)
    return {"number" if k == "integer" else k for k in kinds}


def _disjoint_objects(left: Any, right: Any) -> bool:
    """Two object schemas no instance matches both: one requires a property the other, closed,
    does not have."""

    def excludes(a: Any, b: Any) -> bool:
        missing = set(a.get("required", [])) - set(b.get("properties", {}))
        return bool(missing) and b.get("additionalProperties") is False

    return excludes(left, right) or excludes(right, left)


def _admits_null(schema: Any, document: Any) -> bool:
    schema = _resolve(schema, document)
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    if None in schema.get("enum", []):
        return True
    branches = (schema.get("oneOf") or []) + (schema.get("anyOf") or [])
    return any(_admits_null(branch, document) for branch in branches)


def _admits_text(schema: Any, text: str, document: Any) -> bool:
    """Whether ``text``, sent as a query value, is one the parameter's schema allows."""
    schema = _resolve(schema, document)
    if schema.get("type") == "array":
        return _admits_text(schema["items"], text, document)
    if schema.get("type") != "string":
        return False  # integers, numbers, booleans: the text is none of them
    if "enum" in schema:
        return text in schema["enum"]
    if "format" in schema:
        assert schema["format"] == "date-time", schema
        return False
    pattern = schema.get("pattern")
    return pattern is None or re.search(pattern, text) is not None


def _concrete(path: str, operation: Any) -> str:
    for parameter in operation.get("parameters", []):
        if parameter["in"] == "path":
            value = PATH_VALUES[parameter["schema"]["type"]]
            path = path.replace("{" + parameter["name"] + "}", value)
    return path


async def test_no_union_in_the_document_has_branches_one_value_can_match(
    served: tuple[Served, ApiClient],
) -> None:
    """`oneOf` wants exactly one branch to match: a union whose branches overlap (`integer`
    and `number`: a metric value of 3) rejects a valid value."""
    _, client = served
    document = (await client.call("GET", "/openapi.json", token=None)).body
    unions = [s["oneOf"] for s in _schemas(document) if "oneOf" in s]
    assert unions
    for branches in unions:
        for n, left in enumerate(branches):
            for right in branches[n + 1 :]:
                shared = _json_types(left, document) & _json_types(right, document)
                if shared == {"object"}:
                    ok = _disjoint_objects(_resolve(left, document), _resolve(right, document))
                    assert ok, (left, right)
                else:
                    assert not shared, (left, right)


async def test_no_query_parameter_is_documented_as_nullable(
    served: tuple[Served, ApiClient],
) -> None:
    """An optional query parameter is absent or a value: there is no way to send a JSON null in
    a query string, and the text `null` is not one either."""
    _, client = served
    document = (await client.call("GET", "/openapi.json", token=None)).body
    parameters = [
        (path, method, parameter)
        for path, item in document["paths"].items()
        for method, operation in item.items()
        for parameter in operation.get("parameters", [])
    ]
    assert parameters
    for path, method, parameter in parameters:
        assert not _admits_null(parameter["schema"], document), (path, method, parameter)


async def test_null_is_a_value_of_no_query_parameter(served: tuple[Served, ApiClient]) -> None:
    """`?presence=null`, `?until=null`, ...: a 400 naming the parameter, as any value the
    document does not allow; where the document allows the text `null` (a device id), it is
    that text, not "no filter"."""
    _, client = served
    document = (await client.call("GET", "/openapi.json", token=None)).body
    refused: list[str] = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if path == "/stream" or method not in METHODS:
                continue  # an event stream: test_stream_api checks its parameters
            for parameter in operation.get("parameters", []):
                if parameter["in"] != "query":
                    continue
                name = parameter["name"]
                # The other required query parameters given (`GET /device/telemetry?id=`).
                given = "".join(
                    f"&{p['name']}={PATH_VALUES[p['schema']['type']]}"
                    for p in operation.get("parameters", [])
                    if p["in"] == "query" and p.get("required") and p["name"] != name
                )
                target = f"{_concrete(path, operation)}?{name}=null{given}"
                where = (method, target)
                if _admits_text(parameter["schema"], "null", document):
                    if method == "get":
                        reply = await client.call("GET", target)
                        assert reply.status in (200, 404), (where, reply.body)
                    continue
                reply = await client.call(method.upper(), target)
                assert reply.status == 400, (where, reply.body)
                assert (reply.body["error"], reply.body["param"]) == ("BAD_REQUEST", name), where
                refused.append(f"{method} {path} {name}")
    assert {"get /devices presence", "get /devices/{id}/telemetry until"} <= set(refused)
    for text in ("NULL", "Null"):  # msgspec reads `null` in any case as None
        reply = await client.call("GET", f"/devices/dev-0/telemetry?until={text}")
        assert (reply.status, reply.body["param"]) == (400, "until"), text


async def test_options_names_every_method_the_path_serves(
    served: tuple[Served, ApiClient],
) -> None:
    """OPTIONS is answered on every path, without a token, and is not an operation of the
    document; its `Allow` is the path's documented methods and OPTIONS, as a 405's is, and HEAD
    wherever GET is (but the stream: tests/integration/api/test_api_head_requests.py)."""
    _, client = served
    document = (await client.call("GET", "/openapi.json", token=None)).body
    assert "`OPTIONS`" in document["info"]["description"]
    for path, item in document["paths"].items():
        methods = [m for m in item if m in METHODS]
        assert "options" not in item, path
        target = _concrete(path, item[methods[0]])
        expected = {m.upper() for m in methods} | {"OPTIONS"}
        if "get" in methods and path != "/stream":
            expected.add("HEAD")
        async with client.http.options(f"{client.base}{target}") as response:
            assert response.status == 204, target
            allow = {m.strip() for m in response.headers["Allow"].split(",")}
        assert allow == expected, target
        unserved = next(m for m in METHODS if m not in methods)
        reply = await client.call(unserved.upper(), target)
        assert reply.status == 405, (unserved, target)
        assert {m.strip() for m in reply.headers["Allow"].split(",")} == expected, target


async def test_every_list_has_one_envelope_items_and_one_cursor_named_for_its_parameter(
    served: tuple[Served, ApiClient],
) -> None:
    """docs/api.md, "Lists: one envelope": every GET answering a list has `items`; a paged one
    exactly one `next_<param>` cursor whose `<param>` is a query parameter of the operation;
    a property kept under its old name is marked deprecated."""
    _, api = served
    document = (await api.get("/openapi.json", token=None)).body
    schemas = document["components"]["schemas"]
    lists = 0
    for path, item in document["paths"].items():
        operation = item.get("get")
        if operation is None:
            continue
        answer = operation["responses"]["200"]["content"].get("application/json")
        if answer is None:
            continue
        schema = _resolve(answer["schema"], document)
        properties = schema.get("properties", {})
        arrays = [n for n, p in properties.items() if _resolve(p, document).get("type") == "array"]
        # (`next_attempt_at` and the like are times, not cursors.)
        cursors = [n for n in properties if n.startswith("next_") and not n.endswith("_at")]
        if not cursors and "items" not in properties:
            continue  # one thing, not a list
        lists += 1
        assert "items" in properties, (path, sorted(properties))
        assert len(cursors) <= 1, (path, cursors)
        parameters = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
        for cursor in cursors:
            assert cursor.removeprefix("next_") in parameters, (path, cursor, parameters)
        for name in arrays:
            if name != "items":
                assert properties[name].get("deprecated") is True, (path, name)
    assert lists >= 12, lists
    health = schemas["Health"]["properties"]
    assert health["auditFailures"]["deprecated"] is True
    assert all(re.fullmatch(r"[a-z_]+", k) for k in health if k != "auditFailures"), sorted(health)
