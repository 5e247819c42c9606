"""Prefill/decode disaggregation end to end: ``moeserve router`` (the real sglang-router) in
front of ``moeserve serve --disaggregation-mode prefill|decode`` instances, driven by the
official ``openai`` client, greedy, against one colocated ``moeserve serve`` of the same
checkpoint (float32, one thread everywhere).

    default   1P1D on the demo model (DeepSeek-V3 layout, MLA): completions and chat,
              streamed and not, with logprobs; prompts of several prefill chunks (the
              prefill instances run --max-num-batched-tokens 64); the prefill instance's
              prefix cache; 8 concurrent streams. 2P1D and 1P2D (the router spreads the
              requests). Requests with bad bootstrap fields; a router pointed at a colocated
              instance. (50-70 s on two shared cores)
    slow      1P1D on a Qwen3-MoE checkpoint (GQA), the same checks. Faults: a decode
              instance killed mid-stream, a prefill instance killed with requests in
              flight, a prefill engine that stops answering (SIGSTOP). (90-130 s)

After each group of checks every instance has every block free, nothing parked, and a KV
self-check that passes (``/debug/engine``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from moeserve.demo import demo_model_path
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


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _aclient(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def complete(url: str, model: str, prompt, stream: bool, max_tokens: int = 12) -> Out:
    """A greedy completion with ``logprobs=2``."""
    params = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2)
    with _client(url) as client:
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
    async with _aclient(url) as client:
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
    with _client(url) as client:
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


@pytest.fixture(scope="module")
def demo():
    d = deploy(str(demo_model_path()))
    yield d
    stop_all(d.instances)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from tests.checkpoints import build_hf_model, save_hf_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "qwen3-moe-tiny"
    save_hf_checkpoint(build_hf_model("qwen3_moe"), path)
    d = deploy(str(path))
    yield d
    stop_all(d.instances)


@pytest.fixture(scope="module", params=["demo", pytest.param("qwen", marks=pytest.mark.slow)])
def pd(request) -> Deployment:
    """1P1D on the demo model (MLA), and on a Qwen3-MoE checkpoint (GQA) in the slow run."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def pd_router(pd):
    router = pc.start_router(pd.prefill, pd.decode)
    yield router
    router.stop()


def disagg_stats(server: RunningServer) -> dict:
    return pc.engine_stats(server)["disaggregation"]


# -- 1P1D ----------------------------------------------------------------------------------------


def test_the_router_lists_the_served_model_name(pd, pd_router):
    """sglang-router lists each worker's ``served_model_name`` (from /server_info) in its
    /v1/models: the name a client reads there must be one the instances accept."""
    with _client(pd_router.url) as client:
        listed = client.models.list().data[0].id
        assert listed == pd.model
        r = client.completions.create(model=listed, prompt="hello", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"


# sglang-router 0.3.2 takes no token-id prompts (422 "data did not match any variant of untagged
# enum StringOrArray"): text only. The tokenizer adds a BOS token, so the shortest prompt is two
# tokens (one moves, the decode instance computes the other); an empty one is refused.
PROMPTS = {
    "two tokens": "a",
    "short": "The expert said",
    "one chunk": words(random.Random(1), 25),
    "three chunks": words(random.Random(2), 90),
    "many chunks": words(random.Random(3), 200),
}


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_completions_match_colocated(pd, pd_router, stream):
    lengths = []
    for name, prompt in PROMPTS.items():
        want = complete(pd.colocated.url, pd.model, prompt, stream=False)
        got = complete(pd_router.url, pd.model, prompt, stream=stream)
        assert_same(got, want, name)
        lengths.append(want.prompt_tokens)
    assert lengths[0] == 2 and max(lengths) > 4 * CHUNK
    pc.wait_idle(pd.instances)


CHATS = {
    "short": [{"role": "user", "content": "Name three experts."}],
    "long": [
        {"role": "system", "content": words(random.Random(4), 60)},
        {"role": "user", "content": words(random.Random(5), 80)},
        {"role": "assistant", "content": words(random.Random(6), 20)},
        {"role": "user", "content": "And then?"},
    ],
}


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_chat_matches_colocated(pd, pd_router, stream):
    for name, messages in CHATS.items():
        want = chat(pd.colocated.url, pd.model, messages, stream=False)
        got = chat(pd_router.url, pd.model, messages, stream=stream)
        assert_same(got, want, name)
    assert want.prompt_tokens > 2 * CHUNK
    pc.wait_idle(pd.instances)


BLOCK = 16  # the instances' KV block size (the default)


def test_the_prefill_instance_reuses_its_prefix_cache(pd, pd_router):
    """The same prompt twice, then one that shares a long prefix with it: the prefill
    instance serves the repeated blocks from its cache, and the outputs stay the colocated
    ones."""
    (prefill,) = pd.prefill
    rng = random.Random(7)
    base = words(rng, 150)
    prompts = [base, base, base + " " + words(rng, 30)]
    hits = []
    for i, prompt in enumerate(prompts):
        before = pc.engine_stats(prefill)["prefix_cache_hits"]
        got = complete(pd_router.url, pd.model, prompt, stream=i == 1)
        hits.append(pc.engine_stats(prefill)["prefix_cache_hits"] - before)
        want = complete(pd.colocated.url, pd.model, prompt, stream=False)
        assert_same(got, want, f"prompt {i}")
        if i == 0:
            n = want.prompt_tokens
    # the prefill instance computes n - 1 tokens; a hit leaves at least one of them to compute
    assert hits[:2] == [0, BLOCK * ((n - 2) // BLOCK)]
    assert hits[2] >= hits[1] > 4 * CHUNK
    pc.wait_idle(pd.instances)


def concurrent_streams(url: str, model: str, prompts: list[str]) -> list[Out]:
    async def run() -> list[Out]:
        return await asyncio.gather(*(acomplete_stream(url, model, p) for p in prompts))

    return asyncio.run(run())


def test_eight_concurrent_streams_match_colocated(pd, pd_router):
    rng = random.Random(8)
    prompts = [words(rng, rng.randint(3, 250)) for _ in range(8)]
    got = concurrent_streams(pd_router.url, pd.model, prompts)
    for i, (g, p) in enumerate(zip(got, prompts, strict=True)):
        want = complete(pd.colocated.url, pd.model, p, stream=False, max_tokens=16)
        assert_same(g, want, f"stream {i}")
    pc.wait_idle(pd.instances)


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, missing",
    [
        ({"bootstrap_host": "127.0.0.1", "bootstrap_port": 9}, "bootstrap_room"),
        ({"bootstrap_room": 5}, "bootstrap_host"),
        ({"bootstrap_host": "127.0.0.1", "bootstrap_room": 5}, "bootstrap_port"),
    ],
)
def test_a_decode_instance_names_a_missing_bootstrap_field(demo, fields, missing):
    (decode,) = demo.decode
    with _client(decode.url) as client, pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=demo.model, prompt="hello", max_tokens=2, extra_body=fields)
    assert missing in e.value.message
    assert e.value.body.get("param") == missing
    pc.wait_idle(demo.decode)


def test_the_router_refuses_a_colocated_instance_as_prefill(demo):
    (decode,) = demo.decode
    url = demo.colocated.url
    cmd = pc.router_command([url], [decode.url], pc.free_port(span=2))
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"{url} serves as 'null', not as a prefill instance" in done.stderr, done.stderr
    assert time.monotonic() - start < 30


# -- 2P1D and 1P2D -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_spare(demo):
    """A second prefill and a second decode instance next to ``demo``'s."""
    path = str(demo_model_path())
    prefill, decode = pc.start_servers(prefill_args(path), pc.decode_args(path))
    yield prefill, decode
    stop_all([prefill, decode])


@pytest.mark.parametrize("shape", ["2P1D", "1P2D"])
def test_the_router_spreads_requests_over_instances(demo, demo_spare, shape):
    """Twelve distinct prompts at once: each instance of the doubled role serves some of
    them, and every output is the colocated one."""
    prefill, decode = list(demo.prefill), list(demo.decode)
    (prefill if shape == "2P1D" else decode).append(demo_spare[0 if shape == "2P1D" else 1])
    spread = prefill if shape == "2P1D" else decode
    before = [disagg_stats(s)["transfers"] for s in spread]
    rng = random.Random(f"spread {shape}")
    prompts = [words(rng, rng.randint(20, 200)) for _ in range(12)]
    router = pc.start_router(prefill, decode)
    try:
        got = concurrent_streams(router.url, demo.model, prompts)
    finally:
        router.stop()
    for i, (g, p) in enumerate(zip(got, prompts, strict=True)):
        want = complete(demo.colocated.url, demo.model, p, stream=False, max_tokens=16)
        assert_same(g, want, f"{shape} stream {i}")
    served = [disagg_stats(s)["transfers"] - b for s, b in zip(spread, before, strict=True)]
    assert sum(served) == len(prompts) and min(served) > 0, served
    pc.wait_idle([*demo.instances, *demo_spare])


# -- faults --------------------------------------------------------------------------------------

PREFILL_TIMEOUT_S = 5  # --disaggregation-transfer-timeout of the fault tests' prefill instances
DECODE_TIMEOUT_S = 3  # and of their decode instances


@dataclass
class FaultRig:
    """Instances the fault tests may stop or kill: ``prefill`` and ``decode`` survive every
    test, each victim serves one test."""

    prefill: RunningServer
    decode: RunningServer
    prefill_victim: RunningServer
    decode_victim: RunningServer


@pytest.fixture(scope="module")
def faults(demo):
    path = str(demo_model_path())
    p_timeout = ("--disaggregation-transfer-timeout", str(PREFILL_TIMEOUT_S))
    d_timeout = ("--disaggregation-transfer-timeout", str(DECODE_TIMEOUT_S))
    servers = pc.start_servers(
        prefill_args(path, *p_timeout),
        pc.decode_args(path, *d_timeout),
        prefill_args(path, *p_timeout),
        pc.decode_args(path, *d_timeout),
    )
    yield FaultRig(*servers)
    stop_all(servers)


def signal_engine(server: RunningServer, sig: int) -> list[int]:
    pids = server.engine_pids()
    assert pids, "the server has no engine process"
    for pid in pids:
        os.kill(pid, sig)
    return pids


@pytest.mark.slow
def test_a_decode_instance_killed_mid_stream(demo, faults):
    """The client's stream ends (an error or a closed stream) soon after the decode instance
    dies; the prefill instance holds nothing and serves on."""
    rig = faults
    router = pc.start_router([rig.prefill], [rig.decode_victim])
    received, error, killed_at = 0, None, None
    try:
        client = openai.OpenAI(base_url=router.v1, api_key="none", max_retries=0, timeout=30)
        events = client.completions.create(
            model=demo.model,
            prompt=words(random.Random(10), 40),
            max_tokens=1500,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        try:
            for chunk in events:
                received += sum(len(ch.text) > 0 for ch in chunk.choices)
                if received == 5:
                    killed_at = time.monotonic()
                    pc.kill(rig.decode_victim)
        except (openai.APIError, httpx.HTTPError) as e:
            error = e
        ended = time.monotonic()
    finally:
        router.stop()
    assert killed_at is not None, f"the stream ended after {received} chunks"
    print(f"decode killed: the stream ended {ended - killed_at:.2f} s later ({error!r})")
    assert received < 1500
    assert ended - killed_at < 15
    pc.wait_idle([rig.prefill])

    # a request whose decode instance never asks fails once the prefill side's timeout passes
    nowhere = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pc.free_port(),
        "bootstrap_room": random.getrandbits(62),
    }
    start = time.monotonic()
    with _client(rig.prefill.url) as client, pytest.raises(openai.InternalServerError) as e:
        client.completions.create(
            model=demo.model, prompt="The expert said", max_tokens=4, extra_body=nowhere
        )
    waited = time.monotonic() - start
    print(f"an orphan prefill request failed after {waited:.2f} s: {e.value.message}")
    assert e.value.status_code == 503
    assert PREFILL_TIMEOUT_S - 0.5 < waited < PREFILL_TIMEOUT_S + 10
    pc.wait_idle([rig.prefill])

    # without bootstrap fields the prefill instance computes the request itself
    prompt = words(random.Random(11), 50)
    want = complete(demo.colocated.url, demo.model, prompt, stream=False)
    assert_same(complete(rig.prefill.url, demo.model, prompt, stream=False), want, "plain")
    pc.wait_idle([rig.prefill])


async def _outcome(url: str, model: str, prompt: str) -> tuple[Out | BaseException, float]:
    start = time.monotonic()
    try:
        out = await acomplete_stream(url, model, prompt)
    except (openai.APIError, httpx.HTTPError) as e:
        return e, time.monotonic() - start
    return out, time.monotonic() - start


def router_workers(router: pc.Router) -> dict[str, bool]:
    listed = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
    return {w["url"].rstrip("/"): w["is_healthy"] for w in listed}


@pytest.mark.slow
def test_a_prefill_instance_killed_with_requests_in_flight(demo, faults):
    """2P1D; one prefill instance stops (so requests wait there), then is killed: every
    request ends in bounded time (the router retries 5xx with another room), the decode
    instance frees its blocks, and once the router's health check drops the dead instance
    every request succeeds."""
    rig = faults
    router = pc.start_router([rig.prefill, rig.prefill_victim], [rig.decode])
    try:
        rng = random.Random(12)
        prompts = [words(rng, rng.randint(20, 120)) for _ in range(8)]
        served = disagg_stats(rig.prefill_victim)["transfers"]
        concurrent_streams(router.url, demo.model, prompts)
        assert disagg_stats(rig.prefill_victim)["transfers"] > served  # it takes requests

        async def run() -> list:
            signal_engine(rig.prefill_victim, signal.SIGSTOP)
            tasks = [asyncio.create_task(_outcome(router.url, demo.model, p)) for p in prompts]
            await asyncio.sleep(1.0)
            await asyncio.to_thread(pc.kill, rig.prefill_victim)
            return await asyncio.gather(*tasks)

        outcomes = asyncio.run(run())
        failed = [repr(o) for o, _ in outcomes if isinstance(o, BaseException)]
        longest = max(t for _, t in outcomes)
        print(
            f"prefill killed: {len(failed)} of {len(prompts)} failed, the last ended after "
            f"{longest:.2f} s: {failed}"
        )
        assert longest < 40
        for (o, _), p in zip(outcomes, prompts, strict=True):
            if not isinstance(o, BaseException):
                want = complete(demo.colocated.url, demo.model, p, stream=False, max_tokens=16)
                assert_same(o, want, "a request that survived")

        dropped = pc.wait_until(
            lambda: not router_workers(router).get(rig.prefill_victim.url, False),
            15,
            "the router drops the dead prefill instance",
        )
        print(f"the router marked the dead prefill instance unhealthy {dropped:.2f} s later")
        pc.wait_idle([rig.prefill, rig.decode])
        got = concurrent_streams(router.url, demo.model, prompts)
    finally:
        router.stop()
    for i, (g, p) in enumerate(zip(got, prompts, strict=True)):
        want = complete(demo.colocated.url, demo.model, p, stream=False, max_tokens=16)
        assert_same(g, want, f"after the kill, stream {i}")
    pc.wait_idle([rig.prefill, rig.decode])


@pytest.mark.slow
def test_a_prefill_engine_that_stops_answering(demo, faults):
    """The prefill instance's engine is stopped (SIGSTOP; its HTTP server still answers
    /health): a request fails within seconds, the decode instance frees its blocks; once the
    engine runs again (SIGCONT) requests succeed."""
    rig = faults
    router = pc.start_router([rig.prefill], [rig.decode])
    prompt = words(random.Random(13), 60)
    want = complete(demo.colocated.url, demo.model, prompt, stream=False)
    try:
        assert_same(complete(router.url, demo.model, prompt, stream=False), want, "before")
        pids = signal_engine(rig.prefill, signal.SIGSTOP)
        try:
            start = time.monotonic()
            client = openai.OpenAI(base_url=router.v1, api_key="none", max_retries=0, timeout=60)
            with pytest.raises((openai.APIStatusError, openai.APIConnectionError)) as e:
                client.completions.create(
                    model=demo.model, prompt=prompt, max_tokens=12, temperature=0
                )
            failed_after = time.monotonic() - start
            print(
                f"prefill engine stopped: the request failed after {failed_after:.2f} s: "
                f"{e.value!r}"
            )
            assert failed_after < 20
            pc.wait_idle([rig.decode])
            r = httpx.get(f"{rig.prefill.url}/health", timeout=10)
            print(f"the stopped prefill instance's /health: {r.status_code} {r.text}")
            assert r.status_code == 503
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        back = pc.wait_until(
            lambda: router_workers(router).get(rig.prefill.url, False),
            15,
            "the router takes the prefill instance back",
        )
        print(f"the router took the prefill instance back {back:.2f} s after SIGCONT")
        for stream in (False, True):
            got = complete(router.url, demo.model, prompt, stream=stream)
            assert_same(got, want, f"after SIGCONT, stream={stream}")
    finally:
        router.stop()
    pc.wait_idle([rig.prefill, rig.decode], timeout=PREFILL_TIMEOUT_S + 15)


# -- parallel layouts --------------------------------------------------------------------------


def layout_outputs(d: Deployment, prefill_extra: tuple, decode_extra: tuple, path: str):
    """Eight prompts through a prefill and a decode instance started with the extra layout
    flags; returns (outputs, prompts, the two instances)."""
    prefill, decode = pc.start_servers(
        prefill_args(path, *prefill_extra), pc.decode_args(path, *decode_extra)
    )
    rng = random.Random(f"layouts {prefill_extra} {decode_extra}")
    prompts = [words(rng, rng.randint(20, 120)) for _ in range(8)]
    try:
        router = pc.start_router([prefill], [decode])
        try:
            got = concurrent_streams(router.url, d.model, prompts)
        finally:
            router.stop()
        pc.wait_idle([prefill, decode])
    finally:
        stop_all([prefill, decode])
    return got, prompts


@pytest.mark.slow
def test_prefill_tp2_into_decode_ep2_matches_colocated(demo):
    """MLA's latent moves from a tensor-parallel prefill instance into one of two
    DP-attention replicas of an expert-parallel decode instance."""
    got, prompts = layout_outputs(demo, ("--tp", "2"), ("--ep", "2"), str(demo_model_path()))
    for i, (g, p) in enumerate(zip(got, prompts, strict=True)):
        want = complete(demo.colocated.url, demo.model, p, stream=False, max_tokens=16)
        assert_same(g, want, f"TP2 -> EP2 stream {i}")


@pytest.mark.slow
def test_gqa_tp2_into_tp2_matches_colocated(qwen):
    """Each decode rank's KV heads come from the prefill rank that holds the same heads."""
    path = json.loads(httpx.get(f"{qwen.colocated.url}/server_info", timeout=10).text)
    got, prompts = layout_outputs(qwen, ("--tp", "2"), ("--tp", "2"), path["model_path"])
    for i, (g, p) in enumerate(zip(got, prompts, strict=True)):
        want = complete(qwen.colocated.url, qwen.model, p, stream=False, max_tokens=16)
        assert_same(g, want, f"GQA TP2 -> TP2 stream {i}")
