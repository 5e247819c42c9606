"""Prefill/decode disaggregation under faults (``test_pd_router.py`` has the setting): a
decode instance killed mid-stream, a prefill instance killed with requests in flight, a
prefill engine that stops answering (SIGSTOP). Each ends in bounded time, the survivors free
every block, and the outputs that come back are the colocated ones. (slow: 90-130 s)
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from moeserve.demo import tiny_model_path
from tests.e2e import pd_cluster as pc
from tests.e2e.pd_compare import (
    Out,
    acomplete_stream,
    assert_same,
    complete,
    concurrent_streams,
    disagg_stats,
    prefill_args,
    stop_all,
    sync_client,
    words,
)
from tests.e2e.server import RunningServer

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
def faults(pd_demo):
    path = str(tiny_model_path())
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
def test_a_decode_instance_killed_mid_stream(pd_demo, faults):
    """The client's stream ends (an error or a closed stream) soon after the decode instance
    dies; the prefill instance holds nothing and serves on."""
    rig = faults
    router = pc.start_router([rig.prefill], [rig.decode_victim])
    received, error, killed_at = 0, None, None
    try:
        client = openai.OpenAI(base_url=router.v1, api_key="none", max_retries=0, timeout=30)
        events = client.completions.create(
            model=pd_demo.model,
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
    with sync_client(rig.prefill.url) as client, pytest.raises(openai.InternalServerError) as e:
        client.completions.create(
            model=pd_demo.model, prompt="The expert said", max_tokens=4, extra_body=nowhere
        )
    waited = time.monotonic() - start
    print(f"an orphan prefill request failed after {waited:.2f} s: {e.value.message}")
    assert e.value.status_code == 503
    assert PREFILL_TIMEOUT_S - 0.5 < waited < PREFILL_TIMEOUT_S + 10
    pc.wait_idle([rig.prefill])

    # without bootstrap fields the prefill instance computes the request itself
    prompt = words(random.Random(11), 50)
    want = complete(pd_demo.colocated.url, pd_demo.model, prompt, stream=False)
    assert_same(complete(rig.prefill.url, pd_demo.model, prompt, stream=False), want, "plain")
    pc.wait_idle([rig.prefill])


async def _outcome(url: str, model: str, prompt: str) -> tuple[Out | BaseException, float]:
    start = time.monotonic()
    try:
        out = await acomplete_stream(url, model, prompt)
    except (openai.APIError, httpx.HTTPError) as e:
        return e, time.monotonic() - start
    return out, time.monotonic() - start


@pytest.mark.slow
def test_a_prefill_instance_killed_with_requests_in_flight(pd_demo, faults):
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
        concurrent_streams(router.url, pd_demo.model, prompts)
        assert disagg_stats(rig.prefill_victim)["transfers"] > served  # it takes requests

        async def run() -> list:
            signal_engine(rig.prefill_victim, signal.SIGSTOP)
            tasks = [asyncio.create_task(_outcome(router.url, pd_demo.model, p)) for p in prompts]
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
                want = complete(
                    pd_demo.colocated.url, pd_demo.model, p, stream=False, max_tokens=16
                )
                assert_same(o, want, "a request that survived")

        dropped = pc.wait_until(
            lambda: not pc.router_workers(router).get(rig.prefill_victim.url, False),
            15,
            "the router drops the dead prefill instance",
        )
        print(f"the router marked the dead prefill instance unhealthy {dropped:.2f} s later")
        pc.wait_idle([rig.prefill, rig.decode])
        got = concurrent_streams(router.url, pd_demo.model, prompts)
    finally:
        router.stop()
    for i, (g, p) in enumerate(zip(got, prompts, strict=True)):
        want = complete(pd_demo.colocated.url, pd_demo.model, p, stream=False, max_tokens=16)
        assert_same(g, want, f"after the kill, stream {i}")
    pc.wait_idle([rig.prefill, rig.decode])


@pytest.mark.slow
def test_a_prefill_engine_that_stops_answering(pd_demo, faults):
    """The prefill instance's engine is stopped (SIGSTOP; its HTTP server still answers
    /health): a request fails within seconds, the decode instance frees its blocks; once the
    engine runs again (SIGCONT) requests succeed."""
    rig = faults
    router = pc.start_router([rig.prefill], [rig.decode])
    prompt = words(random.Random(13), 60)
    want = complete(pd_demo.colocated.url, pd_demo.model, prompt, stream=False)
    try:
        assert_same(complete(router.url, pd_demo.model, prompt, stream=False), want, "before")
        pids = signal_engine(rig.prefill, signal.SIGSTOP)
        try:
            start = time.monotonic()
            client = openai.OpenAI(base_url=router.v1, api_key="none", max_retries=0, timeout=60)
            with pytest.raises((openai.APIStatusError, openai.APIConnectionError)) as e:
                client.completions.create(
                    model=pd_demo.model, prompt=prompt, max_tokens=12, temperature=0
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
            lambda: pc.router_workers(router).get(rig.prefill.url, False),
            15,
            "the router takes the prefill instance back",
        )
        print(f"the router took the prefill instance back {back:.2f} s after SIGCONT")
        for stream in (False, True):
            got = complete(router.url, pd_demo.model, prompt, stream=stream)
            assert_same(got, want, f"after SIGCONT, stream={stream}")
    finally:
        router.stop()
    pc.wait_idle([rig.prefill, rig.decode], timeout=PREFILL_TIMEOUT_S + 15)
