"""``--reasoning-parser deepseek_r1`` through the official ``openai`` client: the thinking
section comes back as ``reasoning_content``, whole and in stream deltas, and structured
output holds only what follows it. The random demo model never closes its thinking section
(``</think>`` is many unlikely tokens), so the section is cut by ``max_tokens``, stays in
``reasoning_content``, and the grammar, waiting for the answer, leaves it free."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.server import API_KEY, start_server

ASK = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def client():
    srv = start_server("--api-key", API_KEY, "--reasoning-parser", "deepseek_r1")
    yield openai.OpenAI(base_url=srv.v1, api_key=API_KEY, max_retries=0, timeout=120)
    srv.stop_cleanly()


@pytest.mark.parametrize("body", [{}, {"response_format": {"type": "json_object"}}])
def test_a_section_cut_by_max_tokens_stays_reasoning_whole_and_streamed(client, body):
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, max_tokens=24, temperature=0.9, seed=2, extra_body=body)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.content is None and whole.message.reasoning_content
    # free text: a grammar applied from the first token would have begun with "{"
    assert not whole.message.reasoning_content.startswith("{") or not body
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (whole.message.reasoning_content, "")
