"""``POST /v1/completions``: one or many prompts (text or token ids), ``n`` samples each.

Choice ``i`` of prompt ``p`` has index ``p * n + i``. ``echo`` puts the prompt before the
completion (and its logprobs first, the first token's as null). Streaming sends one chunk per
choice update, then a usage chunk when ``stream_options.include_usage``, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

from moeserve.serving.errors import bad_request
from moeserve.serving.generation import Generation, merge
from moeserve.serving.logprobs import completion_logprobs
from moeserve.serving.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)
from moeserve.serving.sampling import build_params, check_unsupported, max_tokens_for
from moeserve.serving.state import (
    ServerState,
    full_response,
    new_id,
    sse,
    start_all,
    stream_when_started,
)
from moeserve.serving.structured import guided_params


async def _prompts(
    state: ServerState, req: CompletionRequest
) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt."""
    p = req.prompt
    if isinstance(p, str):
        items = [p]
    elif p and isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    out = []
    for i, item in enumerate(items):
        field = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"'{field}' is empty", field)
            out.append((item, await state.prompts.encode(item, field)))
        else:
            state.check_token_ids(item, field)
            out.append((None, list(item)))
    return out


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    state.check_accepting()
    model = state.model_name(req.model)
    check_unsupported(req)
    guided = await asyncio.to_thread(guided_params, req, state.tokenizer)  # compiles: off the loop
    request_id = new_id("cmpl")
    want_lp = req.logprobs
    generations = []
    for p, (text, ids) in enumerate(await _prompts(state, req)):
        max_tokens = max_tokens_for(
            req.max_tokens, len(ids), state.max_model_len, "prompt", "max_tokens"
        )
        params, options = build_params(
            req,
            state.defaults,
            max_tokens,
            logprobs=want_lp,
            prompt_logprobs=want_lp if (req.echo and want_lp is not None) else None,
            guided=guided,
        )
        if text is None:  # token ids: their text is needed only to echo them
            text = await state.prompts.decode(ids) if req.echo else ""
        generations.append(
            Generation.create(f"{request_id}-{p}", ids, params, options, state.tokenizer, p, text)
        )
    await start_all(state, generations)
    if req.stream:
        events = _stream(state, req, model, request_id, generations)
        return await stream_when_started(request, generations, events)
    return await full_response(request, _collect(state, req, model, request_id, generations))


def _usage(generations: list[Generation]) -> Usage:
    prompt = sum(len(g.prompt_ids) for g in generations)
    completion = sum(g.tracker.num_output_tokens for g in generations)
    cached = sum(g.tracker.num_cached_tokens for g in generations)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _echo_logprobs(state: ServerState, g: Generation, top_n: int) -> CompletionLogprobs:
    entries = g.tracker.prompt_logprobs or [None] * len(g.prompt_ids)
    return completion_logprobs(g.prompt_ids, entries, top_n, state.texts, 0)


async def _collect(
    state: ServerState,
    req: CompletionRequest,
    model: str,
    request_id: str,
    generations: list[Generation],
) -> CompletionResponse:
    async for _ in merge(generations, state.metrics):
        pass
    choices = []
    for g in generations:
        prefix = g.prompt_text if req.echo else ""
        for i, sample in enumerate(g.tracker.samples):
            logprobs = None
            if req.logprobs is not None:
                out = completion_logprobs(
                    sample.token_ids, sample.logprobs, req.logprobs, state.texts, len(prefix)
                )
                if req.echo:
                    head = _echo_logprobs(state, g, req.logprobs)
                    out = _concat(head, out)
                logprobs = out
            choices.append(
                CompletionChoice(
                    index=g.prompt_index * req.n + i,
                    text=prefix + sample.text,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                )
            )
    return CompletionResponse(
        id=request_id, model=model, choices=choices, usage=_usage(generations)
    )


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs,
    )


async def _stream(
    state: ServerState,
    req: CompletionRequest,
    model: str,
    request_id: str,
    generations: list[Generation],
) -> AsyncIterator[str]:
    offsets: dict[int, int] = {}  # choice index -> characters sent
    async for g, deltas in merge(generations, state.metrics):
        choices = []
        for d in deltas:
            index = g.prompt_index * req.n + d.index
            text = d.text
            head = None
            if index not in offsets:
                offsets[index] = 0
                if req.echo:
                    text = g.prompt_text + text
                    if req.logprobs is not None:
                        head = _echo_logprobs(state, g, req.logprobs)
            logprobs = None
            if req.logprobs is not None:
                start = offsets[index] + (len(g.prompt_text) if head is not None else 0)
                logprobs = completion_logprobs(
                    d.token_ids, d.logprobs or [], req.logprobs, state.texts, start
                )
                if head is not None:
                    logprobs = _concat(head, logprobs)
            elif not text and d.finish_reason is None:
                continue
            offsets[index] += len(text)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=d.finish_reason,
                    stop_reason=d.stop_reason,
                )
            )
        if choices:
            yield sse(CompletionResponse(id=request_id, model=model, choices=choices))
    if req.stream_options is not None and req.stream_options.include_usage:
        usage = _usage(generations)
        yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
