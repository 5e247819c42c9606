"""What every endpoint of the API server shares, and the steps common to both generation
endpoints: check the model name, tokenize safely, queue the engine requests, stream them as
server-sent events or wait for them while watching for a client that goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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
    RequestFailedError,
)
from moeserve.serving.errors import APIError, bad_request, quoted
from moeserve.serving.generation import Generation
from moeserve.serving.guard import DEFAULT_MAX_BODY_BYTES
from moeserve.serving.logprobs import TokenTexts
from moeserve.serving.metrics import ServerMetrics
from moeserve.serving.prompts import PromptWorkers
from moeserve.serving.sampling import ModelDefaults
from moeserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer
    model_names: list[str]
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    prompts: PromptWorkers
    defaults: ModelDefaults = field(default_factory=ModelDefaults)
    api_key: str | None = None
    debug_endpoints: bool = False
    reasoning_parser: str | None = None  # split chat answers' thinking (serving/reasoning.py)
    tool_call_parser: str | None = None  # read chat answers' tool calls (serving/tools.py)
    enable_auto_tool_choice: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # sequences the engine queues at most per DP replica (None: unbounded), and the replicas
    max_waiting_requests: int | None = None
    data_parallel_size: int = 1
    model_path: str = ""
    # prefill/decode disaggregation: this instance's role and bootstrap port (prefill)
    disaggregation_mode: str = "null"
    bootstrap_port: int | None = None
    draining: bool = False
    switching_to: str | None = None  # the role this instance is draining for (role_switch.py)
    texts: TokenTexts = field(init=False)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.tokenizer)

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 400 for a model this server does not serve."""
        if requested is None or requested in self.model_names:
            return requested or self.model_names[0]
        raise bad_request(
            f"model {quoted(requested)} is not served here; available: "
            f"{', '.join(self.model_names)}",
            "model",
            "model_not_found",
        )

    def check_accepting(self) -> None:
        if self.client.dead is not None:
            raise unavailable(f"the engine has failed: {self.client.dead}")
        if self.draining:
            raise unavailable("the server is shutting down")
        if self.switching_to is not None:
            raise unavailable(
                f"this instance is switching to the {self.switching_to} role: send the request "
                "to another one"
            )

    def check_ranks(self) -> None:
        """For /health: 503 naming the ranks of the engine group whose heartbeat is late (the
        group still serves; it ends if they stay silent)."""
        missing = self.client.missing_ranks
        if missing:
            raise unavailable(f"{len(missing)} rank(s) missing: " + "; ".join(missing))

    def degraded(self) -> dict | None:
        """For /health: what an elastic engine group went on with after losing ranks (it says
        so at once: GroupHealth), or None while every rank serves."""
        el = self.client.elastic
        if not el or el["live_ranks"] >= el["world_size"]:
            return None
        return {
            "status": "degraded",
            "live_ranks": el["live_ranks"],
            "world_size": el["world_size"],
            "lost": el["lost"],
        }

    def check_engine_answers(self) -> None:
        """For /health: 503 while the engine is stalled (it sent nothing for the bound while
        requests waited; prefill/decode disaggregation only)."""
        if self.client.stalled is not None:
            raise unavailable(self.client.stalled)

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
    already queued are aborted. Maps refusals to 503 / 400; a request with more samples than
    the engine can ever queue is a 400 (a retry could not succeed)."""
    cap = state.max_waiting_requests
    total = sum(g.params.n for g in generations)
    if cap is not None and total > cap * state.data_parallel_size:
        raise bad_request(
            f"the request has {total} samples (prompts x n); the engine queues at most "
            f"{cap * state.data_parallel_size} (--max-waiting-requests {cap} per replica)",
            "n",
        )
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
        if isinstance(e, RequestFailedError):  # the engine stalled before it took the request
            raise unavailable(f"the request failed: {e}") from None
        raise


def sse(chunk: BaseModel | dict) -> str:
    if isinstance(chunk, BaseModel):
        return f"data: {chunk.model_dump_json(exclude_none=False)}\n\n"
    return f"data: {json.dumps(chunk)}\n\n"


def error_event(e: BaseException) -> str:
    if isinstance(e, RequestEndedError):
        err = unavailable(f"the request was ended: {e}")
    elif isinstance(e, RequestFailedError):
        err = unavailable(f"the request failed: {e}")
    elif isinstance(e, EngineDeadError):
        err = APIError(500, f"the engine has failed: {e}", code="engine_dead")
    else:  # our own bug: the log has it, the client gets no exception text
        error_id = uuid.uuid4().hex[:12]
        logger.error("internal error %s in a stream", error_id, exc_info=e)
        message = f"internal server error (id {error_id}; the server log has the details)"
        err = APIError(500, message, code="internal_error")
    return sse(err.body())


def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
    """SSE: ``data: {...}`` events, an error event if the request ends abnormally, then
    ``data: [DONE]``."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as e:
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


async def await_first_outputs(request: Request, generations: list[Generation]) -> None:
    """Wait for each disaggregated generation's first engine output before a stream's
    headers go out: one whose KV never came answers 503 (a router retries that), not a 200
    stream that holds an error event. Raises ClientGone when the client leaves meanwhile."""
    waiting = [g for g in generations if g.params.kv_transfer is not None]
    if not waiting:
        return
    try:
        await until_disconnect(request, asyncio.gather(*(g.first_output() for g in waiting)))
    except RequestFailedError as e:
        for g in generations:
            g.abort()
        raise unavailable(f"the request failed: {e}") from None
    except BaseException:
        for g in generations:
            g.abort()
        raise


async def stream_when_started(
    request: Request, generations: list[Generation], events: AsyncIterator[str]
) -> Response:
    """:func:`stream_response` after :func:`await_first_outputs` (499 if the client left)."""
    try:
        await await_first_outputs(request, generations)
    except ClientGone:
        await events.aclose()
        return Response(status_code=499)
    return stream_response(events)


async def full_response(request: Request, work: Awaitable) -> Response | BaseModel:
    """A non-streaming answer: the engine failing mid-way is a 500/503, a client that left
    gets nothing (499, never sent)."""
    try:
        return await until_disconnect(request, work)
    except ClientGone:
        return Response(status_code=499)
    except RequestEndedError as e:
        raise unavailable(f"the request was ended: {e}") from None
    except RequestFailedError as e:
        raise unavailable(f"the request failed: {e}") from None
    except EngineDeadError as e:
        raise APIError(500, f"the engine has failed: {e}", code="engine_dead") from None
