"""Tool calling through the official ``openai`` client on the demo model, served with
``--tool-call-parser deepseek_v3 --enable-auto-tool-choice``: ``tool_choice="required"``
assembled from streamed deltas, a named function without parallel calls, a conversation
that sends tool results back, ``auto``, and the 400s. The random model is held to calls by
the grammar, so every call's arguments validate against its function's schema."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.server import API_KEY, start_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time"}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    srv = start_server(
        "--api-key", API_KEY, "--tool-call-parser", "deepseek_v3", "--enable-auto-tool-choice"
    )
    yield openai.OpenAI(base_url=srv.v1, api_key=API_KEY, max_retries=0, timeout=120)
    srv.stop_cleanly()


def check_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
        assert len(args["city"]) <= 8
    else:
        assert name == "get_time" and args == {}


def test_required_calls_assembled_from_streamed_deltas(client):
    model = client.models.list().data[0].id
    calls: dict[int, dict] = {}
    reason = None
    for chunk in client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", stream=True,
        max_tokens=1500, temperature=0.8, seed=3,
    ):  # fmt: skip
        for c in chunk.choices:
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id is not None:
                    assert call["id"] is None and d.type == "function"
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
    assert reason == "tool_calls" and calls
    assert sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        assert call["id"].startswith("call_")
        check_call(call["name"], call["arguments"])


def test_a_named_function_and_the_conversation_after_it(client):
    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, parallel_tool_calls=False,
        max_tokens=1500, temperature=0.7, seed=5,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call.function.name, call.function.arguments)
    # the assistant's call and the tool's result go back; the model answers in text
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    after = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=12,
        temperature=0,
    )  # fmt: skip
    assert after.choices[0].message.tool_calls is None
    assert after.choices[0].message.content
    assert after.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result count
    free = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=12, temperature=0
    )  # tool_choice defaults to auto: the random model writes text, and text it stays
    assert free.choices[0].message.content and free.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "objectx"}}}], "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(client, body, field):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, extra_body=body)
    assert e.value.body["param"] == field, e.value.body
