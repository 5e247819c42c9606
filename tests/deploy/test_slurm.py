"""moeserve on a real one-node Slurm cluster (see slurm_cluster.py): ranks started by srun, and
deploy/slurm/moeserve.sbatch as a service, from sbatch to scancel.

Skipped unless root (the set-up installs slurm-wlm and munge with apt-get when missing).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moeserve.demo import write_tiny_model
from tests.deploy.slurm_cluster import (
    KILL_WAIT_S,
    ClusterError,
    SlurmCluster,
    free_port,
    running_cluster,
)

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "moeserve.sbatch"
PD_SCRIPT = SCRIPT.with_name("moeserve-pd.sbatch")
_BASE_URL = re.compile(r"OpenAI base URL: (\S+)")
_READY_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cluster():
    with running_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def model_dir(cluster: SlurmCluster) -> Path:
    # under the cluster's directory: the jobs' command lines name it, the teardown removes it
    return write_tiny_model(cluster.root / "model")


def test_srun_starts_one_rank_per_task_and_only_rank_0_prints(cluster, model_dir):
    name = "moeserve-srun-smoke"
    out = cluster.run(
        *("srun", "--ntasks=2", "--label", f"--job-name={name}"),
        *(sys.executable, "-m", "moeserve.cli", "generate", "--ep", "2"),
        *("--model", str(model_dir), "--prompt", "hi", "--max-tokens", "8", "-q"),
        env={"MASTER_PORT": str(free_port())},
        timeout=300,
    )
    assert out.returncode == 0, f"srun exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    lines = [line for line in out.stdout.split("\n") if line]
    assert lines, f"no output from rank 0:\n{out.stderr}"
    assert all(line.startswith("0: ") for line in lines), out.stdout  # --label: "RANK: text"
    job = cluster.run("squeue", "-h", "--states=all", "-n", name, "-o", "%i").stdout.split()
    assert len(job) == 1, f"expected one job named {name}, squeue says {job}"
    cluster.wait_job_gone(job[0], timeout=30)
    cluster.wait_processes_gone(job[0], timeout=15, marker=str(model_dir))


def test_sbatch_serves_the_api_and_scancel_ends_every_process(cluster, model_dir):
    env = {
        "MOESERVE_PORT": str(free_port()),
        "MASTER_PORT": str(free_port()),
    }
    job = _submit(cluster, SCRIPT, ["--ntasks-per-node=2"], ["--ep", "2"], env, model_dir)
    text = _chat_then_cancel(cluster, job, model_dir, "Hello from Slurm")
    # the script got SIGTERM, passed it on and saw srun end: no rank needed KillWait's SIGKILL
    assert "got SIGTERM" in text and "srun exited with code" in text, text
    # ... and every rank stopped cleanly: the API drained, rank 1 waited for rank 0's stop
    assert "srun exited with code 0" in text, text


def test_pd_sbatch_serves_through_the_router_and_scancel_ends_every_process(cluster, model_dir):
    """moeserve-pd.sbatch on one node: a prefill and a decode instance (srun steps) and the
    router; a chat through the printed base URL moves its KV from the prefill instance to the
    decode instance; scancel ends every process cleanly before KillWait."""
    instance_port = free_port(span=2)
    env = {
        "MOESERVE_PORT": str(free_port(span=2)),  # the router's, and + 1 for its metrics
        "MOESERVE_INSTANCE_PORT": str(instance_port),  # prefill-0, decode-0 on the next one
        "MOESERVE_BOOTSTRAP_PORT": str(free_port()),
    }
    job = _submit(cluster, PD_SCRIPT, ["--ntasks-per-node=1"], ["--threads", "1"], env, model_dir)

    def moved_kv() -> None:
        # the decode instance (instance 1) got the prompt's KV from the prefill instance
        metrics = _metrics(f"http://127.0.0.1:{instance_port + 1}")
        assert metrics["moeserve:disaggregation_role"] == {"decode": 1.0}
        assert sum(metrics["moeserve:kv_transfers"].values()) >= 1, metrics

    text = _chat_then_cancel(cluster, job, model_dir, "Hello from Slurm, disaggregated", moved_kv)
    assert "got SIGTERM" in text, text
    for name in ("prefill-0", "decode-0", "router"):
        assert f"{name} exited with code 0" in text, text


def _submit(cluster, script, sbatch_flags, serve_flags, env, model_dir) -> tuple[str, Path]:
    """sbatch ``script`` on one node with the demo model; returns the job id and its output
    file."""
    env = {
        "MOESERVE_PYTHON": sys.executable,
        "MOESERVE_HEALTH_TIMEOUT": str(_READY_TIMEOUT_S),
        **env,
    }
    sub = cluster.run(
        *("sbatch", "--parsable", "--nodes=1", *sbatch_flags),
        f"--output={cluster.root}/{script.stem}-%j.out",
        *(str(script), "--model", str(model_dir), *serve_flags),
        env=env,
    )
    assert sub.returncode == 0, f"sbatch failed: {sub.stderr}\n{cluster.logs()}"
    job = sub.stdout.strip().split(";")[0]
    return job, cluster.root / f"{script.stem}-{job}.out"


def _chat_then_cancel(cluster, submitted, model_dir, greeting, check=lambda: None) -> str:
    """One greedy chat through the job's printed base URL (then ``check()``), scancel, and
    the checks every job passes: it leaves the queue before KillWait (no process needed
    SIGKILL) and leaves no process behind. Returns the job's output, with a report appended
    for assertion messages."""
    job, output = submitted
    try:
        base_url = _wait_for_base_url(cluster, job, output)
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": greeting}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.usage.completion_tokens > 0, reply
        assert reply.choices[0].message.content, reply
        check()
    except Exception as e:
        raise AssertionError(f"{e}\n{_report(cluster, job, output)}") from e
    finally:
        cancelled = time.monotonic()
        cluster.run("scancel", job)

    cluster.wait_job_gone(job, timeout=KILL_WAIT_S + 30)
    took = time.monotonic() - cancelled
    cluster.wait_processes_gone(job, timeout=15, marker=str(model_dir))
    assert took < KILL_WAIT_S, (
        f"the job took {took:.1f}s to end after scancel, KillWait is {KILL_WAIT_S}s: a process "
        f"did not end on SIGTERM\n{_report(cluster, job, output)}"
    )
    return output.read_text(errors="replace") + "\n" + _report(cluster, job, output)


def _metrics(url: str) -> dict[str, dict[str, float]]:
    """An instance's /metrics: family name -> {role label or sample name: value}."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.labels.get("role", sample.name)
            out.setdefault(family.name, {})[key] = sample.value
    return out


def _wait_for_base_url(cluster: SlurmCluster, job: str, output: Path) -> str:
    """The base URL the script prints once /health answers; fails if the job ends first."""
    deadline = time.monotonic() + _READY_TIMEOUT_S + 30
    while True:
        text = output.read_text(errors="replace") if output.exists() else ""
        if m := _BASE_URL.search(text):
            return m.group(1)
        if not cluster.job_queued(job):
            raise ClusterError(f"job {job} ended before it printed its OpenAI base URL")
        if time.monotonic() > deadline:
            raise ClusterError(f"job {job} printed no OpenAI base URL in {_READY_TIMEOUT_S}s")
        time.sleep(1)


def _report(cluster: SlurmCluster, job: str, output: Path) -> str:
    text = output.read_text(errors="replace") if output.exists() else "(no output file yet)"
    state = cluster.run("scontrol", "show", "job", job).stdout.strip()
    return (
        f"--- {output.name} ---\n{text}\n--- scontrol show job {job} ---\n{state}\n{cluster.logs()}"
    )
