"""``POST /v1/chat/completions``: the conversation rendered with the model's chat template.

Streaming sends, per choice, a first chunk with ``delta.role``, then content chunks, a last
chunk with ``finish_reason``; then a usage chunk when ``stream_options.include_usage``, then
``[DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

from moeserve.serving.errors import bad_request
from moeserve.serving.generation import Generation, merge
from moeserve.serving.logprobs import chat_logprobs
from moeserve.serving.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
)
from moeserve.serving.reasoning import ReasoningSplitter, Split, split_whole
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


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    state.check_accepting()
    model = state.model_name(req.model)
    check_unsupported(req)
    guided = await asyncio.to_thread(guided_params, req, state.tokenizer)  # compiles: off the loop
    ids = await state.prompts.render_chat(
        req.messages,
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template,
        req.chat_template_kwargs,
    )
    requested = req.max_completion_tokens or req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_tokens = max_tokens_for(requested, len(ids), state.max_model_len, "messages", field)
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    params, options = build_params(req, state.defaults, max_tokens, logprobs=top_n, guided=guided)
    request_id = new_id("chatcmpl")
    g = Generation.create(request_id, ids, params, options, state.tokenizer)
    # with --reasoning-parser: whether the template opened (or closed) the thinking section
    tail = _prompt_tail(state, ids)
    await start_all(state, [g])
    if req.stream:
        return await stream_when_started(request, [g], _stream(state, req, model, g, tail))
    return await full_response(request, _collect(state, req, model, g, tail))


def _prompt_tail(state: ServerState, ids: list[int]) -> str | None:
    """The rendered prompt's end, which a reasoning parser reads (None without one)."""
    if state.reasoning_parser is None:
        return None
    return state.tokenizer.decode(ids[-16:], skip_special_tokens=False)


def _usage(g: Generation) -> Usage:
    prompt, completion = len(g.prompt_ids), g.tracker.num_output_tokens
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=g.tracker.num_cached_tokens),
    )


def _logprobs(state: ServerState, req, token_ids, entries) -> ChatChoiceLogprobs | None:
    if not req.logprobs:
        return None
    top_n = req.top_logprobs or 0
    return ChatChoiceLogprobs(content=chat_logprobs(token_ids, entries or [], top_n, state.texts))


async def _collect(
    state: ServerState, req: ChatCompletionRequest, model: str, g: Generation, tail: str | None
) -> ChatCompletionResponse:
    async for _ in merge([g], state.metrics):
        pass
    choices = [
        ChatChoice(
            index=i,
            message=_message(state, s.text, tail),
            logprobs=_logprobs(state, req, s.token_ids, s.logprobs),
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )
        for i, s in enumerate(g.tracker.samples)
    ]
    return ChatCompletionResponse(id=g.request_id, model=model, choices=choices, usage=_usage(g))


def _message(state: ServerState, text: str, tail: str | None) -> ChatResponseMessage:
    if state.reasoning_parser is None:
        return ChatResponseMessage(content=text)
    reasoning, content = split_whole(state.reasoning_parser, text, tail or "")
    return ChatResponseMessage(content=content, reasoning_content=reasoning)


async def _stream(
    state: ServerState, req: ChatCompletionRequest, model: str, g: Generation, tail: str | None
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=g.request_id, model=model, choices=choices, usage=usage))

    splitters = (
        {i: ReasoningSplitter(state.reasoning_parser, tail or "") for i in range(req.n)}
        if state.reasoning_parser is not None
        else None
    )

    def delta(d) -> DeltaMessage | None:
        """The sample's delta message; None when it says nothing yet."""
        if splitters is None:
            return DeltaMessage(content=d.text) if d.text else None
        part = splitters[d.index].feed(d.text)
        if d.finish_reason is not None:
            rest = splitters[d.index].finish()
            part = Split(part.reasoning + rest.reasoning, part.content + rest.content)
        if not part.reasoning and not part.content:
            return None
        return DeltaMessage(content=part.content or None, reasoning_content=part.reasoning or None)

    yield chunk(
        [
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(req.n)
        ]
    )
    async for _, deltas in merge([g], state.metrics):
        choices = []
        for d in deltas:
            message = delta(d)
            if message is None and d.finish_reason is None and not req.logprobs:
                continue
            choices.append(
                ChatChunkChoice(
                    index=d.index,
                    delta=message or DeltaMessage(content=""),
                    logprobs=_logprobs(state, req, d.token_ids, d.logprobs),
                    finish_reason=d.finish_reason,
                    stop_reason=d.stop_reason,
                )
            )
        if choices:
            yield chunk(choices)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], _usage(g))
