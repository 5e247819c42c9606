"""``--reasoning-parser deepseek_r1`` through the official ``openai`` client: the thinking
section comes back as ``reasoning_content``, whole and in stream deltas. The random demo
model is held to a regex that writes a thinking section and an answer, so the split has
something to find; a section cut by ``max_tokens`` stays reasoning."""

from __future__ import annotations

import re

import openai
import pytest

from tests.e2e.server import API_KEY, start_server

ASK = [{"role": "user", "content": "Think, then answer."}]
SHAPE = {"guided_regex": r"[a-z]{4,8} [a-z]{4,8}</think>[A-Z][a-z]{3,6}"}


@pytest.fixture(scope="module")
def client():
    srv = start_server("--api-key", API_KEY, "--reasoning-parser", "deepseek_r1")
    yield openai.OpenAI(base_url=srv.v1, api_key=API_KEY, max_retries=0, timeout=120)
    srv.stop_cleanly()


def test_reasoning_content_whole_and_streamed(client):
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, max_tokens=40, temperature=0.8, seed=2, extra_body=SHAPE)
    whole = client.chat.completions.create(**kw).choices[0]
    assert re.fullmatch(r"[a-z]{4,8} [a-z]{4,8}", whole.message.reasoning_content)
    assert re.fullmatch(r"[A-Z][a-z]{3,6}", whole.message.content)
    reasoning, content, reason = "", "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            reason = c.finish_reason or reason
    assert (reasoning, content, reason) == (
        whole.message.reasoning_content,
        whole.message.content,
        "stop",
    )


def test_a_section_cut_by_max_tokens_stays_reasoning(client):
    model = client.models.list().data[0].id
    cut = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=3, temperature=0, extra_body=SHAPE
    ).choices[0]
    assert cut.finish_reason == "length"
    assert cut.message.content is None and cut.message.reasoning_content
