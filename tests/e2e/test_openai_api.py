"""The server through the official ``openai`` client: chat and completions, streaming and
not, n, stop, seed, logprobs, echo, and many concurrent streams."""

from __future__ import annotations

import asyncio
import math

import pytest

CHAT = [{"role": "user", "content": "Tell me about the experts."}]


def _stream_chat(client, model, **kw) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(model=model, messages=CHAT, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_chat_streaming_matches_non_streaming(client, model):
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
    assert full.object == "chat.completion"
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    texts, reasons, usage = _stream_chat(
        client, model, max_tokens=24, temperature=0, stream_options={"include_usage": True}
    )
    assert texts[0] == choice.message.content
    assert reasons == {0: "length"}
    assert usage.completion_tokens == 24
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_streaming_and_echo(client, model):
    prompt = "The expert said"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    assert full.object == "text_completion"
    text = full.choices[0].text
    assert full.usage.completion_tokens == 16
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == text
    echoed = client.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + text


def test_completions_token_prompt_and_batch(client, model, http):
    ids = http.post("/tokenize", json={"prompt": "The expert said"}).json()["tokens"]
    by_text = client.completions.create(
        model=model, prompt="The expert said", max_tokens=8, temperature=0
    )
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(
        model=model, prompt=["The expert said", "Routing"], max_tokens=8, temperature=0, n=2
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    first = next(c for c in batch.choices if c.index == 0)
    assert first.text == by_text.choices[0].text
    assert batch.usage.completion_tokens == 32


def test_n_and_seed_reproducible(client, model):
    kw = dict(model=model, messages=CHAT, max_tokens=16, temperature=1.0, n=2, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert len(a.choices) == 2
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    c = client.chat.completions.create(**{**kw, "seed": 99})
    assert [x.message.content for x in c.choices] != [x.message.content for x in a.choices]
    texts, _, _ = _stream_chat(client, model, max_tokens=16, temperature=1.0, n=2, seed=1234)
    assert [texts[0], texts[1]] == [x.message.content for x in a.choices]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, model, stream):
    base = client.completions.create(
        model=model, prompt="The expert said", max_tokens=40, temperature=0
    ).choices[0]
    text = base.text
    stop = next(
        text[i : i + 3]
        for i in range(6, len(text) - 3)
        if text[i : i + 3].strip() and text.find(text[i : i + 3]) == i
    )
    kw = dict(model=model, prompt="The expert said", max_tokens=40, temperature=0, stop=[stop])
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.completions.create(**kw).choices[0]
        got, reason = choice.text, choice.finish_reason
    assert got == text[: text.index(stop)]
    assert reason == "stop"
    extra = {"include_stop_str_in_output": True}
    kept = client.completions.create(extra_body=extra, **kw).choices[0].text
    assert kept == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_a_stop_string(client, model, stream):
    kw = dict(model=model, prompt="The expert said", temperature=0, max_tokens=40)
    text = client.completions.create(**kw).choices[0].text
    for m in range(6, 12):  # the text of the first m tokens, not ending inside a character
        head = client.completions.create(**{**kw, "max_tokens": m}).choices[0].text
        if not head.endswith("\ufffd"):
            break
    assert text.startswith(head)
    # a stop string in the first m tokens' text that comes again later, if one does
    pairs = [head[i : i + 2] for i in range(len(head) - 1) if head[i : i + 2].strip()]
    stop = next((p for p in pairs if text.find(p, len(head) - 1) != -1), text[:2])

    def complete(min_tokens: int) -> tuple[str, str]:
        body = dict(stop=[stop], extra_body={"min_tokens": min_tokens}, **kw)
        if not stream:
            choice = client.completions.create(**body).choices[0]
            return choice.text, choice.finish_reason
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **body) if c.choices]
        return "".join(c.text for c in chunks), chunks[-1].finish_reason

    assert complete(0) == (text[: text.index(stop)], "stop")
    # vLLM's rule: the stop string may not end in the text of the first min_tokens tokens
    later = text.find(stop, len(head) - len(stop) + 1)
    assert complete(m) == ((text[:later], "stop") if later != -1 else (text, "length"))


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    raw = b"".join(bytes(t.bytes) for t in content)
    assert raw.decode("utf-8", "replace") == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token
        assert math.isclose(t.top_logprobs[0].logprob, t.logprob, rel_tol=1e-5, abs_tol=1e-6)
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token or t.token.startswith("bytes:")
    streamed = list(
        client.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    tokens = [t for c in streamed for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [t.token for t in tokens] == [t.token for t in content]


def test_completion_logprobs_with_echo(client, model):
    r = client.completions.create(
        model=model, prompt="The expert said", max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0
    assert lp.text_offset[n_prompt] == len("The expert said")
    for token, logprob, top in zip(
        lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]
    ):
        assert len(top) >= 2 and top[token] == logprob


def test_fifty_concurrent_streams(aclient, model):
    """50 sampled streams at once, each with its own seed, give what the same request gives
    alone: a seeded sequence draws only from its own generator (``layers/sampler.py``),
    whatever shares its batch. Every tenth request is run again alone (about 1.5 s each)."""

    async def one(i: int) -> tuple[int, int, int, str]:
        stream = await aclient.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=10 + i % 7,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks, usage, text = 0, None, ""
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            chunks += sum(1 for c in chunk.choices if c.delta.content)
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return 10 + i % 7, usage.completion_tokens, chunks, text

    async def all_of_them():
        together = await asyncio.gather(*(one(i) for i in range(50)))
        alone = {i: await one(i) for i in range(0, 50, 10)}
        return together, alone

    together, alone = asyncio.run(all_of_them())
    assert all(want == got for want, got, _, _ in together)
    assert all(0 < chunks <= want for want, _, chunks, _ in together)
    assert len({text for *_, text in together}) == 50  # the seeds give 50 different streams
    for i, (_, _, _, text) in alone.items():
        assert together[i][3] == text, f"request {i} alone differs from it among 50"


def test_models_version_health_tokenize(client, http, model, server):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200
    tok = http.post("/tokenize", json={"prompt": "hello experts", "add_special_tokens": False})
    ids = tok.json()["tokens"]
    assert tok.json()["count"] == len(ids) > 0
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "hello experts"
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > len(ids)
    assert chat["max_model_len"] == models[0].model_extra["max_model_len"]
