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

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

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


async def refresh_engine_stats(state: ServerState) -> dict | None:
    """Ask the engine for its stats (between two steps); None when it cannot answer."""
    try:
        stats = await state.client.call("stats", timeout=STATS_TIMEOUT_S)
    except (asyncio.TimeoutError, RuntimeError):
        return None
    state.metrics.set_engine_stats(stats)
    return stats


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(
        title="moeserve",
        version=moeserve.__version__,
        description="OpenAI-compatible API of a Mixture-of-Experts inference engine.",
    )
    app.state.server = state
    install_handlers(app)

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

    auth = [Depends(check_api_key)]

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if state.client.dead is not None:
            raise unavailable(f"the engine has failed: {state.client.dead}")
        if state.draining:
            raise unavailable("the server is shutting down")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=moeserve.__version__)

    @app.get("/metrics")
    async def metrics() -> Response:
        await refresh_engine_stats(state)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth, responses=_ERRORS)
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

    @app.post(
        "/v1/completions",
        dependencies=auth,
        response_model=CompletionResponse,
        responses=_ERRORS,
    )
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)

    @app.post(
        "/v1/chat/completions",
        dependencies=auth,
        response_model=ChatCompletionResponse,
        responses=_ERRORS,
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)

    @app.post("/tokenize", dependencies=auth, responses=_ERRORS)
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

    @app.post("/detokenize", dependencies=auth, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.model_name(body.model)
        state.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens, False))

    if state.debug_endpoints:

        @app.get("/debug/engine", dependencies=auth, responses=_ERRORS)
        async def debug_engine() -> JSONResponse:
            stats = await refresh_engine_stats(state)
            if stats is None:
                raise unavailable("the engine did not answer")
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

        @app.get("/admin/eplb", dependencies=auth, responses=_ERRORS)
        async def eplb_status() -> JSONResponse:
            return await eplb("status")

        @app.post("/admin/eplb/rebalance", dependencies=auth, responses=_ERRORS)
        async def eplb_rebalance() -> JSONResponse:
            return await eplb("rebalance")

        @app.post("/admin/eplb/dump", dependencies=auth, responses=_ERRORS)
        async def eplb_dump() -> JSONResponse:
            return await eplb("dump")

    return app
