"""The same ``moeserve generate`` under every launcher gives the one-process answer: ranks
spawned by moeserve, torchrun, an srun-style environment, and two hosts in network
namespaces joined by a veth pair (skipped with the reason where namespaces cannot be made)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from moeserve.launch.spec import free_port
from tests.checkpoints import build_hf_model, save_hf_checkpoint

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


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


@pytest.fixture
def two_hosts():
    """Namespaces a and b with 10.231.0.1 and 10.231.0.2 on the two ends of a veth pair."""
    tag = uuid.uuid4().hex[:6]
    hosts = [f"msa{tag}", f"msb{tag}"]
    probe = _ip("netns", "add", hosts[0])
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {probe.stderr.strip()}")
    try:
        steps = [
            ("netns", "add", hosts[1]),
            ("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"),
            ("link", "set", f"va{tag}", "netns", hosts[0]),
            ("link", "set", f"vb{tag}", "netns", hosts[1]),
            ("-n", hosts[0], "addr", "add", "10.231.0.1/24", "dev", f"va{tag}"),
            ("-n", hosts[1], "addr", "add", "10.231.0.2/24", "dev", f"vb{tag}"),
        ]
        for ns, dev in zip(hosts, (f"va{tag}", f"vb{tag}")):
            steps += [("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the veth link: ip {' '.join(step)}: {done.stderr}")
        yield hosts
    finally:
        for ns in hosts:
            _ip("netns", "del", ns)  # deletes its end of the veth pair too


def test_two_hosts_in_network_namespaces(ckpt, expected, two_hosts):
    master = ["--master-addr", "10.231.0.1", "--master-port", "29517", "--nnodes", "2"]
    procs = []
    for node, ns in enumerate(two_hosts):
        cmd = ["ip", "netns", "exec", ns, *generate_cmd(ckpt, "--ep", "2", *master)]
        cmd += ["--node-rank", str(node)]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert [out for out, _ in outs] == [expected, ""]
