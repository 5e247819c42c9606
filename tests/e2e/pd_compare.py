"""Greedy requests through the ``openai`` client, their results in one shape from each of the
four APIs, and the comparison with a colocated server's; the deployments the prefill/decode
tests compare (``test_pd_*.py``; the instances themselves: ``pd_cluster.py``)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx
import openai

from tests.e2e import pd_cluster as pc
from tests.e2e.server import RunningServer

LOGPROB_TOL = 1e-4
CHUNK = 64  # the prefill instances' --max-num-batched-tokens: long prompts take several steps
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega expert router token cache block prefill decode"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# -- results in one shape, from each of the four APIs -------------------------------------------


@dataclass
class Out:
    text: str
    tokens: list[str]
    logprobs: list[float]
    top: list[dict[str, float]]
    finish_reason: str | None
    prompt_tokens: int | None = None


def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def complete(url: str, model: str, prompt, stream: bool, max_tokens: int = 12) -> Out:
    """A greedy completion with ``logprobs=2``."""
    params = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2)
    with sync_client(url) as client:
        if not stream:
            r = client.completions.create(**params)
            ch, lp = r.choices[0], r.choices[0].logprobs
            return Out(
                ch.text,
                lp.tokens,
                lp.token_logprobs,
                lp.top_logprobs,
                ch.finish_reason,
                r.usage.prompt_tokens,
            )
        out = Out("", [], [], [], None)
        for chunk in client.completions.create(**params, stream=True):
            _add_completion_chunk(out, chunk)
        return out


def _add_completion_chunk(out: Out, chunk) -> None:
    for ch in chunk.choices:
        out.text += ch.text
        if ch.logprobs is not None:
            out.tokens += ch.logprobs.tokens
            out.logprobs += ch.logprobs.token_logprobs
            out.top += ch.logprobs.top_logprobs
        out.finish_reason = ch.finish_reason or out.finish_reason


async def acomplete_stream(url: str, model: str, prompt, max_tokens: int = 16) -> Out:
    out = Out("", [], [], [], None)
    async with async_client(url) as client:
        events = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=2,
            stream=True,
        )
        async for chunk in events:
            _add_completion_chunk(out, chunk)
    return out


def concurrent_streams(url: str, model: str, prompts: list[str]) -> list[Out]:
    async def run() -> list[Out]:
        return await asyncio.gather(*(acomplete_stream(url, model, p) for p in prompts))

    return asyncio.run(run())


def chat(url: str, model: str, messages: list[dict], stream: bool, max_tokens: int = 12) -> Out:
    """A greedy chat completion with ``logprobs=True, top_logprobs=2``."""
    params = dict(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    out = Out("", [], [], [], None)
    with sync_client(url) as client:
        if not stream:
            r = client.chat.completions.create(**params)
            ch = r.choices[0]
            out.text, out.finish_reason = ch.message.content, ch.finish_reason
            out.prompt_tokens = r.usage.prompt_tokens
            _add_chat_logprobs(out, ch.logprobs.content)
            return out
        for chunk in client.chat.completions.create(**params, stream=True):
            for ch in chunk.choices:
                out.text += ch.delta.content or ""
                if ch.logprobs is not None:
                    _add_chat_logprobs(out, ch.logprobs.content or [])
                out.finish_reason = ch.finish_reason or out.finish_reason
    return out


def _add_chat_logprobs(out: Out, content) -> None:
    for t in content:
        out.tokens.append(t.token)
        out.logprobs.append(t.logprob)
        out.top.append({x.token: x.logprob for x in t.top_logprobs})


def assert_same(got: Out, want: Out, what: str) -> None:
    """The same text, tokens, top-2 candidates and finish reason; logprobs within
    LOGPROB_TOL."""
    assert got.text == want.text, what
    assert got.tokens == want.tokens, what
    assert got.finish_reason == want.finish_reason, what
    assert len(got.logprobs) == len(want.logprobs) == len(got.tokens), what
    for i, (a, b) in enumerate(zip(got.logprobs, want.logprobs, strict=True)):
        assert abs(a - b) <= LOGPROB_TOL, f"{what}: token {i}: {a} vs {b}"
    for i, (a, b) in enumerate(zip(got.top, want.top, strict=True)):
        assert set(a) == set(b), f"{what}: token {i}'s candidates: {a} vs {b}"
        for tok in a:
            assert abs(a[tok] - b[tok]) <= LOGPROB_TOL, f"{what}: token {i}, {tok!r}"


# -- deployments --------------------------------------------------------------------------------


@dataclass
class Deployment:
    model: str  # the name clients send
    colocated: RunningServer
    prefill: list[RunningServer]
    decode: list[RunningServer]

    @property
    def instances(self) -> list[RunningServer]:
        return [self.colocated, *self.prefill, *self.decode]


def model_name(server: RunningServer) -> str:
    return httpx.get(f"{server.v1}/models", timeout=10).json()["data"][0]["id"]


def prefill_args(path: str, *extra: str) -> tuple[str, ...]:
    return pc.prefill_args(path, "--max-num-batched-tokens", str(CHUNK), *extra)


def deploy(path: str) -> Deployment:
    """A colocated instance, a prefill instance with CHUNK-token steps, a decode instance."""
    colocated, prefill, decode = pc.start_servers(
        pc.colocated_args(path), prefill_args(path), pc.decode_args(path)
    )
    return Deployment(model_name(colocated), colocated, [prefill], [decode])


def stop_all(servers: list[RunningServer]) -> None:
    for s in servers:
        pc.stop(s)


def disagg_stats(server: RunningServer) -> dict:
    return pc.engine_stats(server)["disaggregation"]
