"""The same ``moeserve generate`` under every launcher gives the one-process answer: ranks
spawned by moeserve, torchrun, an srun-style environment, and two hosts in network
namespaces joined by a veth pair (skipped with the reason where namespaces cannot be made)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moeserve.launch.spec import free_port
from tests.checkpoints import build_hf_model, save_hf_checkpoint
from tests.netns import HOST_A, in_host, two_hosts

GENERATE = ["-m", "moeserve.cli", "generate", "--prompt", "The expert said", "-q"]
GENERATE += ["--max-tokens", "12", "--dtype", "float32", "--max-model-len", "64"]
TIMEOUT = 180


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf_checkpoint(build_hf_model("deepseek_v3"), tmp_path_factory.mktemp("launch"))


def generate_cmd(ckpt, *extra: str) -> list[str]:
    return [sys.executable, *GENERATE, "--model", str(ckpt), *extra]


def run(cmd, env=None) -> str:
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def expected(ckpt) -> str:
    out = run(generate_cmd(ckpt))
    assert out.strip()
    return out


def test_spawned_ranks(ckpt, expected):
    assert run(generate_cmd(ckpt, "--ep", "2")) == expected


def test_torchrun(ckpt, expected):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port())]
    cmd += generate_cmd(ckpt, "--tp", "2")[1:]
    # only rank 0 prints the answer
    assert run(cmd) == expected


def test_srun_environment(ckpt, expected):
    """Two tasks with the variables srun sets (srun itself is not on this machine)."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS="2")
        env.update(SLURM_LOCALID=str(rank), SLURM_NNODES="1", SLURM_NODEID="0")
        env.update(SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="2")
        env.update(SLURM_JOB_ID="4242", MASTER_PORT=port)
        cmd = generate_cmd(ckpt, "--ep", "2")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [expected, ""]


@pytest.fixture
def hosts():
    with two_hosts() as names:
        yield names


def test_two_hosts_in_network_namespaces(ckpt, expected, hosts):
    master = ["--master-addr", HOST_A, "--master-port", "29517", "--nnodes", "2"]
    procs = []
    for node, ns in enumerate(hosts):
        cmd = in_host(ns, generate_cmd(ckpt, "--ep", "2", *master))
        cmd += ["--node-rank", str(node)]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert [out for out, _ in outs] == [expected, ""]
