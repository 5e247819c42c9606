"""What every HTTP request passes before the application sees it (a pure ASGI middleware),
in this order:

1. the API key (401), before a byte of the body is read: without the key, a malformed body
   is a 401 too, and nothing about the API (not even ``/openapi.json``) is served; only
   ``public_paths`` pass;
2. the body-size limit (413), from ``Content-Length`` at once, or while a chunked body
   arrives;
3. the nesting depth of a JSON body (400), counted on the raw bytes before anything parses
   them (the parser, pydantic and the chat template all recurse);
4. a last line for our own bugs: one log record with the traceback, and a 500 that names an
   error id but carries no exception text.

The body is read once here and handed on; after it, the application's ``receive`` is the
client's (so a disconnect still reaches the handlers that watch for one).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import numpy as np

from moeserve.serving.errors import APIError, bad_request

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_JSON_DEPTH = 64
_INLINE_SCAN_BYTES = 1 << 16  # larger bodies are scanned on a thread (numpy frees the GIL)
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in ``body`` (JSON text; brackets inside
    strings do not count, escaped quotes do not end a string). Vectorized: it runs at memory
    speed, whatever the nesting."""
    a = np.frombuffer(body, np.uint8)
    steps = _STEP[a]
    brackets = np.flatnonzero(steps)
    if brackets.size == 0:
        return 0
    quotes = np.flatnonzero(a == ord('"'))
    if quotes.size:
        after_bs = quotes[(quotes > 0) & (a[quotes - 1] == ord("\\"))]
        if after_bs.size:
            # a quote is escaped when an odd run of backslashes precedes it
            idx = np.arange(a.size, dtype=np.int64)
            last_other = np.maximum.accumulate(np.where(a == ord("\\"), -1, idx))
            run = after_bs - 1 - last_other[after_bs - 1]
            escaped = after_bs[(run & 1) == 1]
            quotes = np.setdiff1d(quotes, escaped, assume_unique=True)
        # a bracket lies outside strings when an even number of quotes precede it
        brackets = brackets[(np.searchsorted(quotes, brackets) & 1) == 0]
        if brackets.size == 0:
            return 0
    return int(np.cumsum(steps[brackets], dtype=np.int64).max(initial=0))


class _ClientGone(Exception):
    pass


class RequestGuard:
    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        api_key: str | None,
        public_paths: Iterable[str],
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_json_depth: int = MAX_JSON_DEPTH,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.public_paths = frozenset(public_paths)
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_key(scope)
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(scope, receive)
                await self._check_depth(body)
                receive = _replay(body, receive)
        except APIError as e:
            await _send_error(send, e)
            return
        except _ClientGone:
            return
        await self._run(scope, receive, send)

    def _check_key(self, scope: Scope) -> None:
        if self.api_key is None or scope["path"] in self.public_paths:
            return
        given = _header(scope, b"authorization") or b""
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token, self.api_key.encode()):
            raise APIError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", None, "invalid_api_key"
            )

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise bad_request("the Content-Length header is not a number")
            if int(declared) > limit:
                raise _too_large(limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _check_depth(self, body: bytes) -> None:
        limit = self.max_json_depth
        if body.count(b"[") + body.count(b"{") <= limit:
            return  # too few brackets to nest deeper
        if len(body) > _INLINE_SCAN_BYTES:
            depth = await asyncio.to_thread(json_depth, body)
        else:
            depth = json_depth(body)
        if depth > limit:
            raise bad_request(
                f"the body nests arrays and objects {depth} deep; at most {limit} are allowed",
                code="too_deep",
            )

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            logger.exception("internal error %s on %s %s", error_id, scope["method"], scope["path"])
            if not started:
                message = f"internal server error (id {error_id}; the server log has the details)"
                await _send_error(send, APIError(500, message, code="internal_error"))


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {limit} bytes (--max-request-body-bytes)",
        code="request_too_large",
    )


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    if error.status == 413:
        headers.append((b"connection", b"close"))  # the rest of the body is not read
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
