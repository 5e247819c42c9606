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
    slow      1P1D on a Qwen3-MoE checkpoint (GQA), the same checks.

Faults are in ``test_pd_faults.py``, parallel layouts in ``test_pd_layouts.py``, adaptive P/D
in ``test_pd_auto.py``. After each group of checks every instance has every block free,
nothing parked, and a KV self-check that passes (``/debug/engine``).
"""

from __future__ import annotations

import random
import subprocess
import time

import openai
import pytest

from moeserve.demo import tiny_model_path
from tests.e2e import pd_cluster as pc
from tests.e2e.pd_compare import (
    CHUNK,
    Deployment,
    assert_same,
    chat,
    complete,
    concurrent_streams,
    disagg_stats,
    prefill_args,
    stop_all,
    sync_client,
    words,
)


@pytest.fixture(scope="module", params=["demo", pytest.param("qwen", marks=pytest.mark.slow)])
def pd(request) -> Deployment:
    """1P1D on the demo model (MLA), and on a Qwen3-MoE checkpoint (GQA) in the slow run."""
    return request.getfixturevalue(f"pd_{request.param}")


@pytest.fixture(scope="module")
def pd_router(pd):
    router = pc.start_router(pd.prefill, pd.decode)
    yield router
    router.stop()


# -- 1P1D ----------------------------------------------------------------------------------------


def test_the_router_lists_the_served_model_name(pd, pd_router):
    """sglang-router lists each worker's ``served_model_name`` (from /server_info) in its
    /v1/models: the name a client reads there must be one the instances accept."""
    with sync_client(pd_router.url) as client:
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
def test_a_decode_instance_names_a_missing_bootstrap_field(pd_demo, fields, missing):
    (decode,) = pd_demo.decode
    with sync_client(decode.url) as client, pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=pd_demo.model, prompt="hello", max_tokens=2, extra_body=fields
        )
    assert missing in e.value.message
    assert e.value.body.get("param") == missing
    pc.wait_idle(pd_demo.decode)


def test_the_router_refuses_a_colocated_instance_as_prefill(pd_demo):
    (decode,) = pd_demo.decode
    url = pd_demo.colocated.url
    cmd = pc.router_command([url], [decode.url], pc.free_port(span=2))
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"{url} serves as 'null', not as a prefill instance" in done.stderr, done.stderr
    assert time.monotonic() - start < 30


# -- 2P1D and 1P2D -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_spare(pd_demo):
    """A second prefill and a second decode instance next to ``pd_demo``'s."""
    path = str(tiny_model_path())
    prefill, decode = pc.start_servers(prefill_args(path), pc.decode_args(path))
    yield prefill, decode
    stop_all([prefill, decode])


@pytest.mark.parametrize("shape", ["2P1D", "1P2D"])
def test_the_router_spreads_requests_over_instances(pd_demo, demo_spare, shape):
    """Twelve distinct prompts at once: each instance of the doubled role serves some of
    them, and every output is the colocated one."""
    prefill, decode = list(pd_demo.prefill), list(pd_demo.decode)
    (prefill if shape == "2P1D" else decode).append(demo_spare[0 if shape == "2P1D" else 1])
    spread = prefill if shape == "2P1D" else decode
    before = [disagg_stats(s)["transfers"] for s in spread]
    rng = random.Random(f"spread {shape}")
    prompts = [words(rng, rng.randint(20, 200)) for _ in range(12)]
    router = pc.start_router(prefill, decode)
    try:
        got = concurrent_streams(router.url, pd_demo.model, prompts)
    finally:
        router.stop()
    for i, (g, p) in enumerate(zip(got, prompts, strict=True)):
        want = complete(pd_demo.colocated.url, pd_demo.model, p, stream=False, max_tokens=16)
        assert_same(g, want, f"{shape} stream {i}")
    served = [disagg_stats(s)["transfers"] - b for s, b in zip(spread, before, strict=True)]
    assert sum(served) == len(prompts) and min(served) > 0, served
    pc.wait_idle([*pd_demo.instances, *demo_spare])
