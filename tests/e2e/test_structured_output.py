"""Structured output through the official ``openai`` client on the tiny random-weight
model: whatever it would say, the output parses and validates. ``parse`` with a pydantic
model, ``json_object``, vLLM's ``guided_*`` fields (regex, choice, grammar), a batch of
constrained and free requests, streaming, a grammar cut by ``max_tokens`` and bad schemas
answered 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

ASK = [{"role": "user", "content": "Describe one expert of the model."}]


class Expert(BaseModel):
    name: str = Field(max_length=12)
    layer: int = Field(ge=0, le=60)
    kind: Literal["routed", "shared"]
    hot: bool


def test_parse_with_a_pydantic_model(client, model):
    for seed in range(3):
        done = client.beta.chat.completions.parse(
            model=model, messages=ASK, response_format=Expert, max_tokens=120, seed=seed,
            temperature=1.0,
        )  # fmt: skip
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        expert = choice.message.parsed
        assert isinstance(expert, Expert) and 0 <= expert.layer <= 60


def test_json_object_and_streaming(client, model):
    text = ""
    reason = None
    for chunk in client.chat.completions.create(
        model=model, messages=ASK, response_format={"type": "json_object"}, max_tokens=200,
        temperature=0.7, seed=1, stream=True,
    ):  # fmt: skip
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    if reason == "stop":  # the random model may still be inside a long string at the end
        assert isinstance(json.loads(text), dict)
    else:
        assert reason == "length" and text.startswith("{")


def test_guided_fields_of_vllm(client, model):
    rx = r"[a-z]{2,5}-[0-9]{3}"
    out = client.completions.create(
        model=model, prompt="Id:", max_tokens=20, temperature=1.0, seed=3,
        extra_body={"guided_regex": rx},
    )  # fmt: skip
    assert re.fullmatch(rx, out.choices[0].text), out.choices[0].text
    out = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=10, temperature=1.0, seed=4,
        extra_body={"guided_choice": ["routed", "shared expert", "dense"]},
    )  # fmt: skip
    assert out.choices[0].message.content in ("routed", "shared expert", "dense")
    gbnf = 'root ::= "layer " [0-9] [0-9]? ("," " " "ok")?'
    out = client.completions.create(
        model=model, prompt="Where:", max_tokens=20, temperature=1.0, seed=5,
        extra_body={"guided_grammar": gbnf},
    )  # fmt: skip
    assert re.fullmatch(r"layer [0-9][0-9]?(, ok)?", out.choices[0].text), out.choices[0].text


def test_a_batch_of_constrained_and_free_requests(aclient, model):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }

    async def one(i: int):
        body = {"guided_json": schema} if i % 2 else {}
        return await aclient.chat.completions.create(
            model=model, messages=ASK, max_tokens=40, temperature=0.9, seed=i, extra_body=body
        )

    async def main():
        return await asyncio.gather(*(one(i) for i in range(12)))

    for i, out in enumerate(asyncio.run(main())):
        text = out.choices[0].message.content
        if i % 2:
            assert out.choices[0].finish_reason == "stop"
            assert set(json.loads(text)) == {"n"} and 0 <= json.loads(text)["n"] <= 9


def test_a_grammar_cut_by_max_tokens_ends_with_length(client, model):
    out = client.completions.create(
        model=model, prompt="Id:", max_tokens=3, temperature=0, extra_body={"guided_regex": "a{50}"}
    )
    assert out.choices[0].finish_reason == "length" and out.choices[0].text == "a" * len(
        out.choices[0].text
    )


@pytest.mark.parametrize(
    "body, field",
    [
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_json": {"type": "objectx"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "strict": True,
                        "schema": {"type": "string", "format": "no-such-format"},
                    },
                }
            },
            "response_format",
        ),  # fmt: skip
        ({"thinking_token_budget": 8}, "thinking_token_budget"),  # no --reasoning-parser
    ],
)
def test_bad_structured_output_is_a_400_naming_the_field(client, model, body, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, extra_body=body)
    assert e.value.body["param"] == field, e.value.body
