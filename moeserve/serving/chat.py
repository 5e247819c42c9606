"""``POST /v1/chat/completions``: the conversation rendered with the model's chat template.

Streaming sends, per choice, a first chunk with ``delta.role``, then content chunks (and
``reasoning_content`` or ``tool_calls`` deltas: ``serving/answers.py``), a last chunk with
``finish_reason``; then a usage chunk when ``stream_options.include_usage``, then
``[DONE]``. Tool calling (``serving/tools.py``) shows the tools to the template, may hold
the sampling to calls, and reads the answer's calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from moeserve.serving.answers import AnswerStream, read_whole
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
from moeserve.serving.reasoning import thinking_mode
from moeserve.serving.sampling import build_params, check_unsupported, max_tokens_for
from moeserve.serving.state import (
    ServerState,
    full_response,
    new_id,
    sse,
    start_all,
    stream_when_started,
)
from moeserve.serving.structured import after_thinking, check_compiles, guided_params
from moeserve.serving.tool_parsers import ToolFormat
from moeserve.serving.tools import plan_tools


@dataclass(frozen=True)
class _Reading:
    """How a sample's text becomes the answer's parts."""

    reasoning_parser: str | None
    prompt_tail: str  # whether the template opened (or closed) the thinking section
    fmt: ToolFormat | None  # the tool-call format, when the request's calls are read


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    state.check_accepting()
    model = state.model_name(req.model)
    check_unsupported(req)
    tools = await asyncio.to_thread(
        plan_tools, req, state.tool_call_parser, state.enable_auto_tool_choice, state.tokenizer
    )
    guided = await asyncio.to_thread(guided_params, req, state.tokenizer)  # compiles: off the loop
    if tools.guided is not None:
        if guided is not None:
            raise bad_request(
                "a tool_choice that requires calls and structured output cannot go together",
                "tool_choice",
            )
        # the tools' parameters schemas, compiled: off the loop
        await asyncio.to_thread(check_compiles, tools.guided, state.tokenizer, "tools")
        guided = tools.guided
    ids = await state.prompts.render_chat(
        req.messages,
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template,
        req.chat_template_kwargs,
        tools=tools.tools,
    )
    requested = req.max_completion_tokens or req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_tokens = max_tokens_for(requested, len(ids), state.max_model_len, "messages", field)
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    request_id = new_id("chatcmpl")
    tail = ""
    budget = req.thinking_token_budget
    if state.reasoning_parser is not None:
        tail = state.tokenizer.decode(ids[-16:], skip_special_tokens=False)
        # the grammar holds the answer after the thinking section, and the section's length
        guided = after_thinking(guided, thinking_mode(state.reasoning_parser, tail), budget)
        if budget is not None and guided is not None:
            field = "thinking_token_budget"
            await asyncio.to_thread(check_compiles, guided, state.tokenizer, field)
    elif budget is not None:
        raise bad_request(
            "thinking_token_budget needs the server started with --reasoning-parser",
            "thinking_token_budget",
        )
    params, options = build_params(req, state.defaults, max_tokens, logprobs=top_n, guided=guided)
    g = Generation.create(request_id, ids, params, options, state.tokenizer)
    reading = _Reading(state.reasoning_parser, tail, tools.fmt)
    await start_all(state, [g])
    if req.stream:
        return await stream_when_started(request, [g], _stream(state, req, model, g, reading))
    return await full_response(request, _collect(state, req, model, g, reading))


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
    state: ServerState, req: ChatCompletionRequest, model: str, g: Generation, reading: _Reading
) -> ChatCompletionResponse:
    async for _ in merge([g], state.metrics):
        pass
    choices = []
    for i, s in enumerate(g.tracker.samples):
        answer = read_whole(s.text, reading.reasoning_parser, reading.prompt_tail, reading.fmt)
        message = ChatResponseMessage(
            content=answer.content,
            reasoning_content=answer.reasoning,
            tool_calls=answer.tool_calls,
        )
        called = answer.tool_calls and s.finish_reason == "stop"
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=_logprobs(state, req, s.token_ids, s.logprobs),
                finish_reason="tool_calls" if called else s.finish_reason,
                stop_reason=s.stop_reason,
            )
        )
    return ChatCompletionResponse(id=g.request_id, model=model, choices=choices, usage=_usage(g))


async def _stream(
    state: ServerState, req: ChatCompletionRequest, model: str, g: Generation, reading: _Reading
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=g.request_id, model=model, choices=choices, usage=usage))

    plain = reading.reasoning_parser is None and reading.fmt is None
    answers = {
        i: AnswerStream(reading.reasoning_parser, reading.prompt_tail, reading.fmt)
        for i in range(req.n)
    }

    def delta(d) -> DeltaMessage | None:
        """The sample's delta message; None when it says nothing yet."""
        if plain:
            return DeltaMessage(content=d.text) if d.text else None
        part = answers[d.index].feed(d.text, d.finish_reason is not None)
        if not part:
            return None
        return DeltaMessage(
            content=part.content or None,
            reasoning_content=part.reasoning or None,
            tool_calls=part.tool_calls or None,
        )

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
            reason = d.finish_reason
            if reason == "stop" and answers[d.index].called:
                reason = "tool_calls"
            choices.append(
                ChatChunkChoice(
                    index=d.index,
                    delta=message or DeltaMessage(content=""),
                    logprobs=_logprobs(state, req, d.token_ids, d.logprobs),
                    finish_reason=reason,
                    stop_reason=d.stop_reason,
                )
            )
        if choices:
            yield chunk(choices)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], _usage(g))
