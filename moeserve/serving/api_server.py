"""The FastAPI application: OpenAI-compatible endpoints plus health, metrics and tokenizer
endpoints. :func:`build_app` takes a ready :class:`ServerState`; ``launcher.py`` runs it.

    GET  /health /version /metrics /v1/models
    POST /v1/completions /v1/chat/completions /tokenize /detokenize
    GET  /debug/engine          (with --enable-debug-endpoints: stats and the KV self-check)
    GET  /admin/eplb            (with --enable-debug-endpoints: expert-load balancing state)
    POST /admin/eplb/rebalance  re-place the experts from the load window now
    POST /admin/eplb/dump       write the load window to --expert-stats-out

With an API key, every path but /health, /version and /metrics needs
``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import moeserve
from moeserve.serving.chat import create_chat_completion, render_prompt
from moeserve.serving.client import EngineDeadError
from moeserve.serving.completions import create_completion
from moeserve.serving.errors import APIError, ErrorResponse, bad_request, install_handlers
from moeserve.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from moeserve.serving.state import ServerState, unavailable

_PUBLIC = {"/health", "/version", "/metrics", "/openapi.json", "/docs", "/redoc"}
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 503)}
STATS_TIMEOUT_S = 5.0
EPLB_TIMEOUT_S = 300.0  # a re-placement moves every layer's experts before answering


def refresh_engine_stats(state: ServerState) -> None:
    """Hand the engine's latest stats snapshot to the metrics. The engine publishes them on its
    own (``engine_core.SnapshotSchedule``), so a scrape sends it nothing and costs it nothing."""
    snap = state.client.stats
    if snap is not None:
        state.metrics.set_engine_stats(snap.stats, snap.seq, state.client.stats_received_at)


def build_app(state: ServerState) -> FastAPI:
    """The application over ``state``: its routers in this order (the order of
    /openapi.json), every one but :func:`public_router` behind the API key."""
    app = FastAPI(
        title="moeserve",
        version=moeserve.__version__,
        description="OpenAI-compatible API of a Mixture-of-Experts inference engine.",
    )
    app.state.server = state
    install_handlers(app)
    auth = [Depends(api_key_check(state))]
    app.include_router(public_router(state))
    app.include_router(openai_router(state), dependencies=auth)
    app.include_router(tokenizer_router(state), dependencies=auth)
    if state.debug_endpoints:
        app.include_router(debug_router(state), dependencies=auth)
    return app


def api_key_check(state: ServerState):
    """A dependency that refuses (401) a request without ``Authorization: Bearer KEY`` when
    the server has a key; the paths of ``_PUBLIC`` pass without one."""

    async def check_api_key(request: Request) -> None:
        key = state.api_key
        if key is None or request.url.path in _PUBLIC:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", None, "invalid_api_key"
            )

    return check_api_key


def public_router(state: ServerState) -> APIRouter:
    """GET /health (503 once the engine failed or the server drains), /version, /metrics."""
    router = APIRouter()

    @router.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if state.client.dead is not None:
            raise unavailable(f"the engine has failed: {state.client.dead}")
        if state.draining:
            raise unavailable("the server is shutting down")
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=moeserve.__version__)

    @router.get("/metrics")
    async def metrics() -> Response:
        refresh_engine_stats(state)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def openai_router(state: ServerState) -> APIRouter:
    """OpenAI's GET /v1/models, POST /v1/completions and /v1/chat/completions."""
    router = APIRouter()

    @router.get("/v1/models", responses=_ERRORS)
    async def models() -> ModelList:
        cards = [
            ModelCard(
                id=name,
                root=state.model_path,
                max_model_len=state.max_model_len,
                vocab_size=state.vocab_size,
            )
            for name in state.model_names
        ]
        return ModelList(data=cards)

    @router.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)

    return router


def tokenizer_router(state: ServerState) -> APIRouter:
    """POST /tokenize (a prompt or chat messages) and /detokenize, with the server's
    tokenizer."""
    router = APIRouter()

    @router.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        state.model_name(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = render_prompt(
                state,
                body.messages,
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
                body.add_special_tokens,
            )
        else:
            ids = state.encode(body.prompt, "prompt", body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)

    @router.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.model_name(body.model)
        state.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens, False))

    return router


def debug_router(state: ServerState) -> APIRouter:
    """GET /debug/engine (the engine's stats and KV self-check) and the EPLB admin calls:
    GET /admin/eplb, POST /admin/eplb/rebalance and /admin/eplb/dump."""
    router = APIRouter()

    @router.get("/debug/engine", responses=_ERRORS)
    async def debug_engine() -> JSONResponse:
        try:  # asked now, between two steps, with the KV self-check (not the snapshot)
            stats = await state.client.call("stats", timeout=STATS_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError):
            raise unavailable("the engine did not answer") from None
        return JSONResponse(stats)

    async def eplb(action: str) -> JSONResponse:
        try:
            result = await state.client.call(
                "eplb", timeout=EPLB_TIMEOUT_S, args={"action": action}
            )
        except (asyncio.TimeoutError, EngineDeadError):
            raise unavailable("the engine did not answer") from None
        except RuntimeError as e:  # the engine's answer: what was wrong
            raise bad_request(str(e)) from None
        return JSONResponse(result)

    @router.get("/admin/eplb", responses=_ERRORS)
    async def eplb_status() -> JSONResponse:
        return await eplb("status")

    @router.post("/admin/eplb/rebalance", responses=_ERRORS)
    async def eplb_rebalance() -> JSONResponse:
        return await eplb("rebalance")

    @router.post("/admin/eplb/dump", responses=_ERRORS)
    async def eplb_dump() -> JSONResponse:
        return await eplb("dump")

    return router
