"""``--reasoning-parser deepseek_r1`` through the official ``openai`` client: the thinking
section comes back as ``reasoning_content``, whole and in stream deltas, and structured
output and required tool calls hold only what follows it.

The random demo model rarely writes ``</think>`` (one token of 512), so a section cut by
``max_tokens`` stays in ``reasoning_content`` and the grammar, waiting for the answer, leaves
it free. ``thinking_token_budget`` (vLLM's) closes the section after that many tokens: the
complete split, the answer held after it, and a required tool call after it."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.server import API_KEY, start_server

ASK = [{"role": "user", "content": "Think, then answer."}]
END = "</think>"
VERDICT = {
    "type": "object",
    "properties": {"ok": {"enum": ["yes", "no"]}},
    "required": ["ok"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time"}}]


@pytest.fixture(scope="module")
def client():
    srv = start_server(
        "--api-key", API_KEY, "--reasoning-parser", "deepseek_r1",
        "--tool-call-parser", "deepseek_v3", "--enable-auto-tool-choice",
    )  # fmt: skip
    yield openai.OpenAI(base_url=srv.v1, api_key=API_KEY, max_retries=0, timeout=120)
    srv.stop_cleanly()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def streamed(client, **kw) -> tuple[str, str, list, str | None]:
    """reasoning, content, tool-call deltas and finish reason of a streamed answer."""
    reasoning, content, calls, reason = "", "", [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reason = c.finish_reason or reason
    return reasoning, content, calls, reason


@pytest.mark.parametrize("body", [{}, {"response_format": {"type": "json_object"}}])
def test_a_section_cut_by_max_tokens_stays_reasoning_whole_and_streamed(client, model, body):
    kw = dict(model=model, messages=ASK, max_tokens=24, temperature=0.9, seed=2, extra_body=body)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.content is None and whole.message.reasoning_content
    # free text: a grammar applied from the first token would have begun with "{"
    assert not whole.message.reasoning_content.startswith("{") or not body
    reasoning, content, _, _ = streamed(client, **kw)
    assert (reasoning, content) == (whole.message.reasoning_content, "")


def test_a_budget_closes_the_section_whole_and_streamed(client, model):
    budget = 6
    kw = dict(
        model=model, messages=ASK, max_tokens=30, temperature=0.9, seed=5, logprobs=True,
        extra_body={"thinking_token_budget": budget},
    )  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    tokens = [t.token for t in whole.logprobs.content]
    # at most `budget` tokens of thinking (and up to 3 that finish a UTF-8 character the
    # budget would cut: the random model writes byte tokens), then the end
    assert END in tokens[: budget + 4]
    end = tokens.index(END)
    text = [bytes(t.bytes).decode("utf-8", "replace") for t in whole.logprobs.content]
    msg = whole.message
    assert msg.reasoning_content and END not in msg.reasoning_content
    assert msg.reasoning_content == b"".join(
        bytes(t.bytes) for t in whole.logprobs.content[:end]
    ).decode("utf-8", "replace")
    answer = b"".join(bytes(t.bytes) for t in whole.logprobs.content[end + 1 :])
    assert (msg.content or "") == answer.decode("utf-8", "replace"), text
    reasoning, content, _, _ = streamed(client, **kw)
    assert (reasoning, content or None) == (msg.reasoning_content, msg.content)


def test_structured_output_holds_the_answer_after_a_budgeted_section(client, model):
    kw = dict(
        model=model, messages=ASK, max_tokens=60, temperature=1.0, seed=7,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "v", "schema": VERDICT, "strict": True}},
        extra_body={"thinking_token_budget": 4},
    )  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop"
    assert whole.message.reasoning_content and END not in whole.message.reasoning_content
    assert json.loads(whole.message.content)["ok"] in ("yes", "no")
    reasoning, content, _, reason = streamed(client, **kw)
    assert (reasoning, content, reason) == (
        whole.message.reasoning_content, whole.message.content, "stop",
    )  # fmt: skip


def test_a_required_tool_call_after_a_budgeted_section(client, model):
    kw = dict(
        model=model, messages=ASK, max_tokens=200, temperature=0.8, seed=3, tools=TOOLS,
        tool_choice="required", extra_body={"thinking_token_budget": 5},
    )  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.reasoning_content and not whole.message.content
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
    reasoning, content, calls, reason = streamed(client, **kw)
    assert reasoning == whole.message.reasoning_content and not content
    assert reason == "tool_calls" and calls[0].function.name == "get_time"


@pytest.mark.parametrize(
    "body, field",
    [({"thinking_token_budget": -1}, "thinking_token_budget"),
     ({"thinking_token_budget": "x"}, "thinking_token_budget")],
)  # fmt: skip
def test_a_bad_budget_is_a_400_naming_it(client, model, body, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == field, e.value.body
