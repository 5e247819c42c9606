"""The FastAPI application: OpenAI-compatible endpoints plus health, metrics and tokenizer
endpoints. :func:`build_app` takes a ready :class:`ServerState`; ``launcher.py`` runs it.

    GET  /health /version /metrics /v1/models
    POST /v1/completions /v1/chat/completions /tokenize /detokenize
    GET  /debug/engine          (with --enable-debug-endpoints: stats and the KV self-check)
    GET  /admin/eplb            (with --enable-debug-endpoints: expert-load balancing state)
    POST /admin/eplb/rebalance  re-place the experts from the load window now
    POST /admin/eplb/dump       write the load window to --expert-stats-out
    POST /admin/disaggregation/role  (a prefill/decode instance: switch roles, role_switch.py)

Every request first passes :class:`RequestGuard` (``guard.py``): with an API key, every path
but /health, /version and /metrics needs ``Authorization: Bearer KEY`` (checked before the
body is read); bodies over ``--max-request-body-bytes`` get 413, JSON nested too deep 400.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import moeserve
from moeserve.serving.chat import create_chat_completion
from moeserve.serving.client import EngineDeadError
from moeserve.serving.completions import create_completion
from moeserve.serving.errors import ErrorResponse, bad_request, install_handlers
from moeserve.serving.guard import RequestGuard
from moeserve.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelInfo,
    ModelList,
    ServerInfo,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from moeserve.serving.role_switch import role_router
from moeserve.serving.state import ServerState, unavailable

PUBLIC_PATHS = ("/health", "/version", "/metrics")
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 413, 503)}
STATS_TIMEOUT_S = 5.0
EPLB_TIMEOUT_S = 300.0  # a re-placement moves every layer's experts before answering


def refresh_engine_stats(state: ServerState) -> None:
    """Hand the engine's latest stats snapshot to the metrics. The engine publishes them on its
    own (``engine_core.SnapshotSchedule``), so a scrape sends it nothing and costs it nothing."""
    snap = state.client.stats
    if snap is not None:
        state.metrics.set_engine_stats(snap.stats, snap.seq, state.client.stats_received_at)


def build_app(state: ServerState) -> FastAPI:
    """The application over ``state``, behind :class:`RequestGuard` (the API key, the body
    limits, our own bugs): its routers in this order (the order of /openapi.json)."""
    app = FastAPI(
        title="moeserve",
        version=moeserve.__version__,
        description="OpenAI-compatible API of a Mixture-of-Experts inference engine.",
    )
    app.state.server = state
    install_handlers(app)
    app.add_middleware(
        RequestGuard,
        api_key=state.api_key,
        public_paths=PUBLIC_PATHS,
        max_body_bytes=state.max_request_body_bytes,
    )
    app.include_router(public_router(state))
    app.include_router(openai_router(state))
    app.include_router(tokenizer_router(state))
    if state.debug_endpoints:
        app.include_router(debug_router(state))
    if state.disaggregation_mode != "null":
        app.include_router(role_router(state))
    return app


def public_router(state: ServerState) -> APIRouter:
    """GET /health (503 once the engine failed or the server drains), /version, /metrics,
    /server_info and /model_info (what a router asks)."""
    router = APIRouter()

    @router.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        state.check_accepting()
        state.check_ranks()
        state.check_engine_answers()
        degraded = state.degraded()  # elastic EP went on without lost ranks: still serving
        if degraded is not None:
            return JSONResponse(degraded)
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=moeserve.__version__)

    @router.get("/server_info")
    async def server_info() -> ServerInfo:
        """What a router asks at registration: the role of this instance (SGLang's names)."""
        mode = state.disaggregation_mode
        return ServerInfo(
            model_path=state.model_path,
            served_model_name=state.model_names[0],
            served_model_names=state.model_names,
            max_model_len=state.max_model_len,
            disaggregation_mode=mode,
            disaggregation_bootstrap_port=state.bootstrap_port,
            disaggregation_transfer_backend="mooncake" if mode != "null" else None,
            version=moeserve.__version__,
        )

    @router.get("/model_info")
    async def model_info() -> ModelInfo:
        return ModelInfo(model_path=state.model_path, tokenizer_path=state.model_path)

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
                root=state.model_names[0],
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
            ids = await state.prompts.render_chat(
                body.messages,
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template,
                body.chat_template_kwargs,
                body.add_special_tokens,
            )
        else:
            ids = await state.prompts.encode(body.prompt, "prompt", body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)

    @router.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.model_name(body.model)
        state.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=await state.prompts.decode(body.tokens))

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
