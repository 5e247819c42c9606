"""What every endpoint of the API server shares, and the steps common to both generation
endpoints: check the model name, tokenize safely, queue the engine requests, stream them as
server-sent events or wait for them while watching for a client that goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from moeserve.serving.client import (
    EngineClient,
    EngineDeadError,
    QueueFullError,
    RejectedError,
    RequestEndedError,
)
from moeserve.serving.errors import APIError, bad_request
from moeserve.serving.generation import Generation
from moeserve.serving.logprobs import TokenTexts
from moeserve.serving.metrics import ServerMetrics
from moeserve.serving.sampling import ModelDefaults
from moeserve.tokenizer import Tokenizer

RETRY_AFTER_S = 1


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer
    model_names: list[str]
    model_path: str
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    defaults: ModelDefaults = field(default_factory=ModelDefaults)
    api_key: str | None = None
    debug_endpoints: bool = False
    draining: bool = False
    texts: TokenTexts = field(init=False)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.tokenizer)

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 400 for a model this server does not serve."""
        if requested is None or requested in self.model_names:
            return requested or self.model_names[0]
        raise bad_request(
            f"model {requested!r} is not served here; available: {', '.join(self.model_names)}",
            "model",
            "model_not_found",
        )

    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down")
        if self.client.dead is not None:
            raise unavailable(f"the engine has failed: {self.client.dead}")

    def encode(self, text: str, field_name: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (UnicodeError, TypeError, ValueError) as e:
            # e.g. a lone UTF-16 surrogate ("\\ud800") that JSON allows but UTF-8 cannot hold
            raise bad_request(f"'{field_name}' cannot be tokenized: {e}", field_name) from None

    def check_token_ids(self, ids: list[int], field_name: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"'{field_name}' has token id {bad}, outside the vocabulary "
                f"(size {self.vocab_size})",
                field_name,
            )


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def start_all(state: ServerState, generations: list[Generation]) -> None:
    """Queue every engine request of an HTTP request, or none: if one is refused, those
    already queued are aborted. Maps refusals to 503 / 400."""
    started: list[Generation] = []
    try:
        for g in generations:
            await g.start(state.client, state.metrics)
            started.append(g)
    except BaseException as e:
        for g in started:
            g.stream.abort()
        if isinstance(e, QueueFullError):
            raise unavailable(str(e)) from None
        if isinstance(e, RejectedError):
            raise bad_request(str(e)) from None
        if isinstance(e, EngineDeadError):
            raise unavailable(f"the engine has failed: {e}") from None
        raise


def sse(chunk: BaseModel | dict) -> str:
    if isinstance(chunk, BaseModel):
        return f"data: {chunk.model_dump_json(exclude_none=False)}\n\n"
    return f"data: {json.dumps(chunk)}\n\n"


def error_event(e: BaseException) -> str:
    if isinstance(e, RequestEndedError):
        err = unavailable(f"the request was ended: {e}")
    elif isinstance(e, EngineDeadError):
        err = APIError(500, f"the engine has failed: {e}", code="engine_dead")
    else:
        err = APIError(500, f"internal error: {type(e).__name__}: {e}")
    return sse(err.body())


def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
    """SSE: ``data: {...}`` events, an error event if the request ends abnormally, then
    ``data: [DONE]``."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except (RequestEndedError, EngineDeadError) as e:
            yield error_event(e)
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


class ClientGone(Exception):
    pass


async def until_disconnect(request: Request, work: Awaitable):
    """Await ``work`` unless the client disconnects first; then cancel it (which aborts its
    engine requests) and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()


async def full_response(request: Request, work: Awaitable) -> Response | BaseModel:
    """A non-streaming answer: the engine failing mid-way is a 500/503, a client that left
    gets nothing (499, never sent)."""
    try:
        return await until_disconnect(request, work)
    except ClientGone:
        return Response(status_code=499)
    except RequestEndedError as e:
        raise unavailable(f"the request was ended: {e}") from None
    except EngineDeadError as e:
        raise APIError(500, f"the engine has failed: {e}", code="engine_dead") from None
