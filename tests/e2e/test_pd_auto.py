"""Adaptive P/D end to end: ``moeserve router --auto-pd`` in front of three one-thread
instances of the demo model (1 prefill, 2 decode), with the controller's pace cut to seconds.

    phase 1   a prefill-heavy load (prompts of ~1500 tokens, 2 output tokens, 8 at once)
              queues prompts on the one prefill instance: a decode instance moves to prefill
    phase 2   a decode-heavy load (short prompts, 64 streamed output tokens, 8 at once) fills
              the one decode instance's 4 slots: a prefill instance moves back to decode

Every request of both phases answers with all its tokens; after each switch every instance
reports the role the controller gave it (``/server_info``, ``/metrics``), the router lists it
there, a few greedy prompts answer as a colocated server does, and every instance is idle.
(35-45 s on two shared cores)
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moeserve.demo import tiny_model_path
from tests.e2e import pd_cluster as pc
from tests.e2e.pd_compare import assert_same, complete, disagg_stats, model_name, stop_all, words
from tests.e2e.server import RunningServer

SLOTS = 4  # every instance's --max-num-seqs: 8 streams on one prefill instance queue 4
AUTO_PD = (
    "--auto-pd",
    "--auto-pd-interval", "0.5",
    "--auto-pd-window", "4",
    "--auto-pd-sustain", "1.5",
    "--auto-pd-cooldown", "3",
    "--auto-pd-min-samples", "3",
    "--auto-pd-queue-high", "2",
    "--auto-pd-ttft-ms", "1000",
    "--auto-pd-tpot-ms", "2000",  # loose: decode is short by its queue, not its pace
    "--auto-pd-drain-timeout", "30",
)  # fmt: skip
SWITCH_WITHIN_S = 90.0
_MOVED = re.compile(r"auto-pd: (\S+) moved from (\w+) to (\w+)")
_FAILED = re.compile(r"auto-pd: (moving .* failed|could not register).*")


@dataclass
class Cluster:
    model: str
    colocated: RunningServer
    instances: list[RunningServer]  # the three the router steers
    router: pc.Router

    def moves(self) -> list[tuple[str, str, str]]:
        """(url, old role, new role) of every switch the router has logged so far."""
        return _MOVED.findall(self.router.text())


@pytest.fixture(scope="module")
def cluster():
    path = str(tiny_model_path())
    slots = ("--max-num-seqs", str(SLOTS))
    servers = pc.start_servers(
        pc.colocated_args(path),
        pc.prefill_args(path, *slots),
        pc.decode_args(path, *slots),
        pc.decode_args(path, *slots),
    )
    colocated, prefill, *decode = servers
    try:
        router = pc.start_router([prefill], decode, *AUTO_PD)
    except BaseException:
        stop_all(servers)
        raise
    yield Cluster(model_name(colocated), colocated, [prefill, *decode], router)
    router.stop()
    stop_all(servers)


# -- load ---------------------------------------------------------------------------------------


@dataclass
class Load:
    """``workers`` threads that each send ``request(worker, i)`` back to back from entering
    the ``with`` block until leaving it; every request's outcome: None when it answered with
    all its tokens, else what went wrong."""

    request: Callable[[int, int], None]
    workers: int
    outcomes: list[str | None] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for w in range(self.workers):
            t = threading.Thread(target=self._run, args=(w,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, kind, *_) -> None:
        """Let each worker finish its request in flight; when the block raised nothing,
        AssertionError naming every request that failed, or a worker still busy a minute
        later."""
        self._stop.set()
        deadline = time.monotonic() + 60
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if kind is not None:
            return
        busy = sum(t.is_alive() for t in self._threads)
        assert not busy, f"{busy} request(s) still running 60 s after the load stopped"
        failed = [o for o in self.outcomes if o is not None]
        assert not failed, f"{len(failed)} of {len(self.outcomes)} requests failed: {failed}"
        assert self.outcomes, "the load sent no request"

    def _run(self, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                self.request(worker, i)
                self.outcomes.append(None)
            except Exception as e:  # noqa: BLE001 - every failure is reported by __exit__
                self.outcomes.append(f"worker {worker}, request {i}: {e!r}")
            i += 1


def prefill_heavy(c: Cluster) -> Callable[[int, int], None]:
    """Distinct prompts of ~1500 tokens (no prefix-cache hit), 2 output tokens."""
    client = openai.OpenAI(base_url=c.router.v1, api_key="none", max_retries=0, timeout=60)

    def request(worker: int, i: int) -> None:
        prompt = words(random.Random(f"prefill-heavy {worker} {i}"), 450)
        r = client.completions.create(
            model=c.model, prompt=prompt, max_tokens=2, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.choices[0].finish_reason == "length", r
        assert r.usage.completion_tokens == 2, r.usage
        assert r.usage.prompt_tokens > 1200, r.usage

    return request


def decode_heavy(c: Cluster, max_tokens: int = 64) -> Callable[[int, int], None]:
    """Short prompts, ``max_tokens`` streamed output tokens (counted by their logprobs)."""
    client = openai.OpenAI(base_url=c.router.v1, api_key="none", max_retries=0, timeout=60)

    def request(worker: int, i: int) -> None:
        prompt = words(random.Random(f"decode-heavy {worker} {i}"), 8)
        tokens, finish = 0, None
        for chunk in client.completions.create(
            model=c.model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
            stream=True, extra_body={"ignore_eos": True},
        ):  # fmt: skip
            for ch in chunk.choices:
                tokens += len(ch.logprobs.tokens) if ch.logprobs is not None else 0
                finish = ch.finish_reason or finish
        assert (tokens, finish) == (max_tokens, "length"), (tokens, finish)

    return request


# -- checks -------------------------------------------------------------------------------------


def wait_move(c: Cluster, old: str, new: str, count: int) -> tuple[str, float]:
    """Until the router has logged ``count`` switches, the last from ``old`` to ``new``; its
    instance's URL and the seconds it took. AssertionError with the router's log if none
    comes within SWITCH_WITHIN_S, a switch fails, or another one comes first."""
    start = time.monotonic()
    while len(c.moves()) < count:
        failed = _FAILED.search(c.router.text())
        assert failed is None, f"a switch failed: {failed.group(0)}\n{c.router.text()}"
        if time.monotonic() - start > SWITCH_WITHIN_S:
            raise AssertionError(
                f"no instance moved from {old} to {new} within {SWITCH_WITHIN_S:g} s:\n"
                + c.router.text()
            )
        time.sleep(0.2)
    moves = c.moves()
    assert len(moves) == count and moves[-1][1:] == (old, new), moves
    return moves[-1][0], time.monotonic() - start


def expected_roles(c: Cluster) -> dict[str, str]:
    """Each instance's role: its first, then every switch the router logged."""
    roles = {s.url: "decode" for s in c.instances}
    roles[c.instances[0].url] = "prefill"
    for url, _, new in c.moves():
        roles[url] = new
    return roles


def reported_roles(server: RunningServer) -> tuple[str, str]:
    """The role in the instance's /server_info and the one its /metrics sets to 1."""
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()["disaggregation_mode"]
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    on = [
        s.labels["role"]
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "moeserve:disaggregation_role" and s.value == 1
    ]
    return info, ",".join(on)


def router_roles(c: Cluster) -> dict[str, str]:
    listed = httpx.get(f"{c.router.url}/workers", timeout=10).json()["workers"]
    return {w["url"].rstrip("/"): w["worker_type"] for w in listed if w["is_healthy"]}


FIXED = [words(random.Random(f"fixed {i}"), n) for i, n in enumerate((3, 40, 150, 400))]


def check_settled(c: Cluster, what: str) -> None:
    """Roles as switched everywhere, greedy outputs as colocated, every instance idle."""
    want = expected_roles(c)
    pc.wait_until(lambda: router_roles(c) == want, 15, f"{what}: the router lists {want}")
    got = {s.url: reported_roles(s) for s in c.instances}
    assert got == {url: (role, role) for url, role in want.items()}, (what, got)
    for i, prompt in enumerate(FIXED):
        expected = complete(c.colocated.url, c.model, prompt, stream=False, max_tokens=16)
        for stream in (False, True):
            answer = complete(c.router.url, c.model, prompt, stream=stream, max_tokens=16)
            assert_same(answer, expected, f"{what}: prompt {i}, stream={stream}")
    pc.wait_idle([c.colocated, *c.instances])


def test_the_controller_moves_instances_as_the_load_changes(cluster):
    c = cluster
    check_settled(c, "at the start")

    with Load(prefill_heavy(c), workers=2 * SLOTS) as load:
        url, took = wait_move(c, "decode", "prefill", count=1)
    print(f"phase 1: {url} moved to prefill after {took:.1f} s; {len(load.outcomes)} requests")
    check_settled(c, "after phase 1")

    prefill = [s for s in c.instances if expected_roles(c)[s.url] == "prefill"]
    before = [disagg_stats(s)["transfers"] for s in prefill]
    # 12 streams of 128 tokens: the one decode instance keeps ~4 waiting behind its 4 slots (8
    # streams of 64 tokens, before the transfers stopped spinning a core each, left it idle
    # between bursts: its queue averaged under 2 and no switch came)
    with Load(decode_heavy(c, max_tokens=128), workers=3 * SLOTS) as load:
        url, took = wait_move(c, "prefill", "decode", count=2)
    served = [disagg_stats(s)["transfers"] - n for s, n in zip(prefill, before, strict=True)]
    print(
        f"phase 2: {url} moved to decode after {took:.1f} s; {len(load.outcomes)} requests, "
        f"the two prefill instances' transfers {served}"
    )
    assert min(served) > 0, f"a prefill instance served nothing in phase 2: {served}"
    check_settled(c, "after phase 2")
    assert len(c.moves()) == 2, c.moves()
