"""Elastic EP across two hosts (network namespaces A and B): ``--ep 4 --enable-elastic-ep``
with ranks 0-1 on host A (the API) and 2-3 on host B. ``kill -9`` of rank 2 on host B in the
middle of 8 streams: host B's agent reports it, the three survivors go on, and every stream is
token for token the one the same service gave before the fault. SIGTERM to node 0 then stops
both hosts cleanly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import build_hf_model, save_hf_checkpoint
from tests.e2e.test_multihost_serve import (
    REPO,
    URL,
    Group,
    _cmdline,
    _health_answer,
    _serve_cmd,
    descendants,
    running_group,
)
from tests.netns import in_host

STREAMS, MAX_TOKENS = 8, 64
ELASTIC = ("--ep-num-redundant-experts", "8", "--enable-elastic-ep", "--threads", "1")


def _elastic_cmd(node: int, model: Path) -> list[str]:
    cmd = _serve_cmd(node, *ELASTIC, "--model", str(model))
    cmd[cmd.index("--ep") + 1] = "4"
    return cmd


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tests' tiny DeepSeek-V3: clear greedy margins (see test_elastic_serve.py)."""
    return save_hf_checkpoint(build_hf_model("deepseek_v3"), tmp_path_factory.mktemp("el") / "ds")


@pytest.fixture
def group(tmp_path, checkpoint):
    with running_group(tmp_path, lambda node: _elastic_cmd(node, checkpoint)) as g:
        yield g


def _streams(group: Group, kill_pid: int | None = None) -> list:
    cmd = [sys.executable, "-m", "tests.e2e.openai_probe", URL, "streams", str(STREAMS)]
    proc = subprocess.Popen(
        in_host(group.hosts[0], [*cmd, str(MAX_TOKENS)]),
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    first = json.loads(proc.stdout.readline())
    assert first == {"started": True}, first
    if kill_pid is not None:
        subprocess.run(["kill", "-9", str(kill_pid)], check=True)
    out, _ = proc.communicate(timeout=300)
    return json.loads(out.strip().splitlines()[-1])["streams"]


def test_a_rank_killed_on_host_b_loses_no_stream(group):
    node0, node1 = group.nodes
    want = _streams(group)
    assert all(isinstance(w, list) and len(w) == MAX_TOKENS for w in want), want
    rank2 = next(
        p
        for p in descendants(node1.proc.pid)
        if "moeserve.launch.worker" in _cmdline(p) and '"rank": 2,' in _cmdline(p)
    )
    got = _streams(group, kill_pid=rank2)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"stream {i} after the loss: {g!r}\nwant {w!r}\n{group.logs()}"
    answer = _health_answer(group)
    assert answer["status"] == 200, answer
    body = json.loads(answer["body"])
    assert body["status"] == "degraded" and body["live_ranks"] == 3, body
    assert "rank 2 (node 1, host" in body["lost"][0] and "10.231.0.2" in body["lost"][0]
    assert "the group goes on without it" in node1.log()
    assert "recovered in" in node0.log()
    assert node1.proc.poll() is None  # host B's agent keeps its other rank
    node0.proc.send_signal(signal.SIGTERM)
    assert group.wait_exit(60) == [0, 0], group.logs()
    assert group.leftovers() == [], group.logs()
