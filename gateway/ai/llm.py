"""The LLM port and its adapters: disabled (the default) and an OpenAI-compatible HTTP client.

The HTTP adapter speaks the chat-completions API that OpenAI, Ollama (``/v1``), vLLM and the
llama.cpp server all implement. It turns every way a call can go wrong into an ``LlmError`` with a
stable code, so the AI worker records a failure as a fact instead of crashing:

- ``LLM_TIMEOUT``: no complete answer within ``timeout_s`` (the whole call, fallback included);
- ``LLM_UNREACHABLE``: connection refused, DNS failure, connection reset or closed mid-answer;
- ``LLM_HTTP_<status>``: a non-2xx answer; ``raw`` holds its body (at most 64 KiB), and
  ``retry_after_s`` the wait its ``Retry-After`` header asks for (seconds or an HTTP date);
- ``LLM_PROTOCOL``: a 2xx answer that is not a chat-completions response (``raw`` holds it:
  a body nested too deeply to decode too), or an answer not even HTTP can follow (a malformed
  response, a redirect to a URL that is not http(s)).

JSON mode: with ``json_mode`` the request asks for ``response_format: {"type": "json_object"}``
(unless the caller already chose one); without it any ``response_format`` is left out. Servers
that do not know the field (older llama.cpp builds, some OpenAI-compatible proxies) answer 400 (or
422) with a message naming ``response_format``: the call is then retried once without it, and
this client stops sending it for the rest of its life, so the next calls take one round trip
again. The prompt still asks for JSON and the output parser validates it either way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, Self

import structlog
import yarl

from gateway.domain.errors import GatewayError
from gateway.domain.redaction import (
    redact_credentials,
    url_credentials,
    userinfo_cut,
    without_userinfo,
)
from gateway.support.retry_after import retry_after_s

if TYPE_CHECKING:
    # Imported where a request is made: a gateway without [ai] never loads aiohttp (about
    # 8 MB of its resident memory; docs/performance.md).
    import aiohttp

log = structlog.get_logger(__name__)

#: Error bodies kept on an ``LlmError``: enough to diagnose, bounded in memory and in the table.
MAX_ERROR_BODY_BYTES = 64 * 1024
#: A summary answer is a few KiB; anything this large is not one, and is not read further.
MAX_RESPONSE_BYTES = 8 * 1024 * 1024

_JSON_OBJECT_FORMAT: Mapping[str, object] = {"type": "json_object"}
# FastAPI-based servers reject an unknown field with 422 where the others say 400.
_REJECTION_STATUSES = frozenset({400, 422})


class LlmError(GatewayError):
    """An LLM call failed; ``code`` is stable (``LLM_TIMEOUT``, ``LLM_HTTP_500`` ...)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        raw: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.raw = raw
        #: The server's ``Retry-After`` (a 429 or 503 that is rate limiting), in seconds.
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class LlmReply:
    text: str
    raw_response: str
    model: str
    finish_reason: str | None


class LlmPort(Protocol):
    model: str

    async def complete(self, request: Mapping[str, object]) -> LlmReply:
        """Send one chat-completions ``request``; raise ``LlmError`` on any failure."""
        ...


class DisabledLlm:
    """The default adapter. With AI disabled no task is ever created; this only guards that."""

    model = "disabled"

    async def complete(self, request: Mapping[str, object]) -> LlmReply:
        raise LlmError("LLM_DISABLED", "AI summaries are disabled in the configuration")


def _check_base_url(base_url: str) -> str:
    url = yarl.URL(base_url)
    if url.scheme not in {"http", "https"} or not url.host:
        # Not quoted: a URL Python cannot split may carry a password no redaction finds.
        raise ValueError("LLM base_url must be an absolute http(s) URL with a host")
    if url.query_string or url.fragment or "?" in base_url or "#" in base_url:
        # The path is appended to it: a query (a `?key=`) would swallow it, and be quoted by
        # every error.
        raise ValueError("LLM base_url must have no query or fragment")
    if userinfo_cut(base_url):
        # A password's `/` ended the host part: the rest of it was in every error's URL.
        raise ValueError("LLM base_url has an '@' after its host: write a '/' in it as %2F")
    return base_url.rstrip("/")


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """Read at most ``limit`` bytes of the body; the flag says whether there was more."""
    try:
        data = await response.content.readexactly(limit + 1)
    except asyncio.IncompleteReadError as short:
        return short.partial, False
    return data[:limit], True


def _decode(data: bytes) -> str:
    # JSON is UTF-8 (RFC 8259); a truncation may split a character, hence "replace".
    return data.decode("utf-8", errors="replace")


def _error_detail(raw: str) -> str:
    """The server's own error message when the body has one, else the start of the body."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python recurses
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])[:500]
        for key in ("error", "detail", "message"):
            if isinstance(body.get(key), str):
                return str(body[key])[:500]
    return raw[:500]


def _parse_reply(raw: str, requested_model: str) -> LlmReply:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise LlmError("LLM_PROTOCOL", f"response is not JSON: {exc}", raw=raw) from exc
    except RecursionError as exc:
        # A body nested deeper than the decoder recurses (a broken proxy, a hostile server):
        # a fact about the answer, not a crash of the worker (and with it of the daemon).
        raise LlmError("LLM_PROTOCOL", "response is nested too deeply", raw=raw) from exc
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise LlmError("LLM_PROTOCOL", "response has no choices[0]", raw=raw)
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise LlmError("LLM_PROTOCOL", "response has no choices[0].message.content text", raw=raw)
    model = body.get("model")
    finish_reason = choices[0].get("finish_reason")
    return LlmReply(
        text=content,
        raw_response=raw,
        # A blank name would break the record's rule (ai_task_model_name_not_blank).
        model=model if isinstance(model, str) and model.strip() else requested_model,
        finish_reason=finish_reason if isinstance(finish_reason, str) else None,
    )


def _redacted(error: LlmError, secrets: list[str]) -> LlmError:
    """``error`` without the client's credentials (the key, the URL's userinfo) nor anything
    that looks like one, in its message and in the server's body it keeps."""
    raw = None if error.raw is None else redact_credentials(error.raw, secrets)
    return LlmError(
        error.code,
        redact_credentials(error.message, secrets),
        raw=raw,
        retry_after_s=error.retry_after_s,
    )


class _Rejected(Exception):
    """The server refused ``response_format``; the caller retries without it."""

    def __init__(self, error: LlmError) -> None:
        super().__init__(error.message)
        self.error = error


class OpenAiCompatibleLlm:
    """Chat completions over HTTP. ``async with`` it, or call ``close()`` when done.

    Pass ``session`` to share a ``ClientSession`` (it is then the caller's to close); otherwise
    one is created on the first call, never in the constructor.
    """

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None,
        timeout_s: float,
        json_mode: bool = True,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"LLM timeout_s must be positive, got {timeout_s}")
        if api_key and url_credentials(base_url):
            raise ValueError("LLM base_url credentials exclude an api_key (both authenticate)")
        self.model = model
        self.url = f"{_check_base_url(base_url)}/chat/completions"
        # What messages and log lines name: an error message is stored, published and shown.
        self.shown_url = without_userinfo(self.url)
        # What no error may carry: a server refusing them may quote them back ("Incorrect
        # API key provided: sk-..."), and an error is stored, published and shown.
        self._secrets = [s for s in (api_key or "", *url_credentials(base_url)) if s]
        self.timeout_s = timeout_s
        self.json_mode = json_mode
        self._headers = {"Accept": "application/json", "Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session = session
        self._owns_session = session is None
        self._send_response_format = json_mode

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None and self._owns_session:
            await session.close()

    def _client(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            # Our own deadline (asyncio.timeout) bounds each call; no session-wide timeout.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
            self._owns_session = True
        return self._session

    def _body(self, request: Mapping[str, object], *, response_format: bool) -> dict[str, object]:
        body = dict(request)
        body.setdefault("model", self.model)
        if response_format:
            body.setdefault("response_format", _JSON_OBJECT_FORMAT)
        else:
            body.pop("response_format", None)
        return body

    async def complete(self, request: Mapping[str, object]) -> LlmReply:
        try:
            return await self._complete(request)
        except LlmError as exc:
            raise _redacted(exc, self._secrets) from exc.__cause__

    async def _complete(self, request: Mapping[str, object]) -> LlmReply:
        requested = request.get("model")
        requested_model = requested if isinstance(requested, str) else self.model
        try:
            async with asyncio.timeout(self.timeout_s):
                if self._send_response_format:
                    try:
                        return await self._post(self._body(request, response_format=True))
                    except _Rejected as rejected:
                        if self._send_response_format:
                            self._send_response_format = False
                            log.warning(
                                "llm_response_format_unsupported",
                                url=self.shown_url,
                                model=requested_model,
                                detail=rejected.error.message,
                            )
                return await self._post(self._body(request, response_format=False))
        except TimeoutError as exc:
            # aiohttp's own socket timeouts are TimeoutErrors too: same code, same meaning.
            raise LlmError(
                "LLM_TIMEOUT", f"no answer from {self.shown_url} within {self.timeout_s}s"
            ) from exc

    async def _post(self, body: dict[str, object]) -> LlmReply:
        """One HTTP exchange. Raises ``_Rejected`` when the server refuses response_format."""
        import aiohttp

        payload = json.dumps(body, ensure_ascii=False).encode()
        requested_model = str(body["model"])
        try:
            async with self._client().post(
                self.url,
                data=payload,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None),
            ) as response:
                if 200 <= response.status < 300:
                    data, truncated = await _read_bounded(response, MAX_RESPONSE_BYTES)
                    if truncated:
                        raise LlmError(
                            "LLM_PROTOCOL",
                            f"response larger than {MAX_RESPONSE_BYTES} bytes",
                            raw=_decode(data[:MAX_ERROR_BODY_BYTES]),
                        )
                    return _parse_reply(_decode(data), requested_model)
                data, _ = await _read_bounded(response, MAX_ERROR_BODY_BYTES)
                status = response.status
                wait_s = retry_after_s(
                    response.headers.get("Retry-After"), date=response.headers.get("Date")
                )
        except aiohttp.ServerTimeoutError:
            raise  # a TimeoutError first: complete() reports it as LLM_TIMEOUT
        except aiohttp.ClientConnectionError as exc:  # refused, DNS, reset, closed mid-answer
            shown = f"{self.shown_url}: {exc or type(exc).__name__}"
            raise LlmError("LLM_UNREACHABLE", shown) from exc
        except aiohttp.ClientPayloadError as exc:  # the body was cut short
            raise LlmError("LLM_UNREACHABLE", f"{self.shown_url}: {exc}") from exc
        except aiohttp.ClientResponseError as exc:  # not even a well-formed HTTP answer
            raise LlmError("LLM_PROTOCOL", f"{self.shown_url}: {exc.message}") from exc
        except aiohttp.ClientError as exc:
            # The rest: a redirect to a URL that is not http(s) or not a URL at all. Named by
            # its class only: its text is that URL, which may carry credentials.
            raise LlmError("LLM_PROTOCOL", f"{self.shown_url}: {type(exc).__name__}") from exc

        raw = _decode(data)
        # Redacted before the message is cut to its length (complete() redacts every error
        # again): a key cut in two there would no longer be found.
        detail = _error_detail(redact_credentials(raw, self._secrets))
        message = f"HTTP {status} from {self.shown_url}: {detail}"
        error = LlmError(f"LLM_HTTP_{status}", message, raw=raw, retry_after_s=wait_s)
        if status in _REJECTION_STATUSES and "response_format" in body and "response_format" in raw:
            raise _Rejected(error)
        raise error
