"""Elastic EP through the server (issue 23): ``moeserve serve --ep 4 --enable-elastic-ep`` keeps
answering when rank 2 is killed (``kill -9``) in the middle of 8 streams, and not one stream
loses or repeats a token: each is compared token by token with the same server before the
fault. The model is the tests' tiny DeepSeek-V3 (peaked logits): the random demo model's
near-ties make its greedy tokens depend on how requests share a step even without a fault
(its kernels are not batch-invariant), so only a model with clear margins can show that the
loss itself changes nothing. /health then says "degraded" with the live rank count, the
metrics count the loss and the recovery, and every survivor's KV cache passes its
self-check. A replacement started with the same flags plus ``--elastic-rejoin 2`` joins:
/health is plain 200 again, the streams are the same again over four replicas, and the
server and the replacement stop cleanly with nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from moeserve.launch.spec import free_port
from tests.checkpoints import build_hf_model, save_hf_checkpoint
from tests.e2e.openai_probe import run_streams
from tests.e2e.server import RunningServer, start_server
from tests.e2e.test_metrics import _scrape
from tests.e2e.test_multihost_serve import _cmdline

STREAMS = 8
MAX_TOKENS = 96


def rank_pid(srv: RunningServer, rank: int) -> int:
    """The pid of launch rank ``rank`` (a spawned worker) of the server's engine group."""
    for pid in srv.engine_pids():
        line = _cmdline(pid)
        if "moeserve.launch.worker" in line and f'"rank": {rank},' in line:
            return pid
    raise AssertionError(f"no rank {rank} among {srv.engine_pids()}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf_checkpoint(build_hf_model("deepseek_v3"), tmp_path_factory.mktemp("el") / "ds")


FLAGS = ("--ep", "4", "--ep-num-redundant-experts", "8", "--enable-elastic-ep", "--threads", "1")


def test_a_killed_rank_loses_no_stream_and_a_replacement_rejoins(checkpoint, tmp_path):
    port = free_port()
    model_flags = ("--model", str(checkpoint), *FLAGS, "--master-port", str(port))
    srv = start_server(*model_flags, "--enable-debug-endpoints")
    replacement = None
    try:
        client = openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        assert httpx.get(f"{srv.url}/health", timeout=10).text == ""  # healthy: empty 200
        want = run_streams(client, model, STREAMS, MAX_TOKENS)
        assert all(isinstance(w, list) and len(w) == MAX_TOKENS for w in want), want
        victim = rank_pid(srv, 2)
        killed_at = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(victim, signal.SIGKILL)

        got = run_streams(client, model, STREAMS, MAX_TOKENS, on_started=kill)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"stream {i} differs after the loss: {g!r} vs {w!r}"
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "degraded" and body["live_ranks"] == 3
        assert body["world_size"] == 4 and "rank 2" in body["lost"][0]
        samples = _scrape(srv.url)
        assert samples[("moeserve:live_ranks", ())] == 3
        assert samples[("moeserve:rank_failures_total", ())] == 1
        assert samples[("moeserve:recoveries_total", ())] == 1
        assert samples[("moeserve:recovery_seconds_count", ())] == 1
        # the documented bound: rank 0 waits for check-ins at most the collective timeout
        # (10 s) + 5 s; a survivor sometimes checks in only at its timeout (open, see
        # docs/benchmarks.md: "one of 8 kills ... found by the 10-s bound")
        assert 0 < samples[("moeserve:recovery_seconds_sum", ())] < 10 + 5 + 1
        stats = httpx.get(f"{srv.url}/debug/engine", timeout=30).json()
        assert stats["integrity"] == "ok" and len(stats["replicas"]) == 3
        again = client.completions.create(
            model=model, prompt="stream 0 says", max_tokens=MAX_TOKENS, temperature=0,
            logprobs=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert again.choices[0].logprobs.tokens == want[0]
        # a replacement for rank 2: the same flags, on this host
        cmd = [sys.executable, "-m", "moeserve.cli", "serve", *model_flags]
        log = open(tmp_path / "replacement.log", "w")
        replacement = subprocess.Popen(
            [*cmd, "--elastic-rejoin", "2", "--master-addr", "127.0.0.1"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while httpx.get(f"{srv.url}/health", timeout=10).text != "":  # degraded until then
            assert replacement.poll() is None, (tmp_path / "replacement.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "replacement.log").read_text()
            time.sleep(0.3)
        # new requests run over a new expert placement: expert rows meet other GEMMs (the
        # kernels are not batch-invariant), which may flip a near-tie even on this model;
        # every stream is whole, and nearly all are token for token the same
        after = run_streams(client, model, STREAMS, MAX_TOKENS)
        assert all(isinstance(a, list) and len(a) == MAX_TOKENS for a in after), after
        assert sum(a == w for a, w in zip(after, want)) >= STREAMS - 2
        stats = httpx.get(f"{srv.url}/debug/engine", timeout=30).json()
        assert stats["integrity"] == "ok" and len(stats["replicas"]) == 4
        assert stats["elastic"]["rejoins"] == 1 and stats["elastic"]["live_ranks"] == 4
        assert _scrape(srv.url)[("moeserve:live_ranks", ())] == 4
    finally:
        code = srv.stop()
    assert code == 0, srv.text()
    assert replacement is not None and replacement.wait(30) == 0
    assert not srv.engine_pids()
    assert "recovered in" in srv.text() and "joined" in srv.text()
