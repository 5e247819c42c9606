"""deploy/slurm/moeserve.sbatch's own logic, with a fake ``srun`` and ``scontrol`` on PATH: no
cluster, no root, a few seconds. The real cluster run is in test_slurm.py.

The fake srun runs as the tasks would: ``FAKE_SRUN=serve`` answers /health on the port the
script passes and records a SIGTERM, ``exit3`` fails at once, ``hang`` never becomes healthy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.slurm_cluster import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "moeserve.sbatch"

_FAKE_SRUN = """\
#!{python}
import http.server, os, pathlib, signal, sys, time

mode = os.environ["FAKE_SRUN"]
if mode == "exit3":
    sys.exit(3)
if mode == "hang":
    time.sleep(300)
port = int(sys.argv[sys.argv.index("--port") + 1])


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def stop(signum, frame):
    pathlib.Path(os.environ["FAKE_SRUN_MARK"]).write_text(signal.Signals(signum).name)
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(_FAKE_SRUN.format(python=sys.executable))
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo localhost\n')
    for tool in (srun, scontrol):
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {
        **env,
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "localhost",
        "MOESERVE_PYTHON": sys.executable,
        "MOESERVE_PORT": str(free_port()),
        "FAKE_SRUN_MARK": str(tmp_path / "srun-got"),
    }


def _start(env: dict[str, str], mode: str, tmp_path: Path, **extra: str) -> subprocess.Popen:
    out = open(tmp_path / "job.out", "wb")
    with out:
        return subprocess.Popen(
            ["bash", str(SCRIPT), "--model", "/nowhere", "--ep", "2"],
            env={**env, "FAKE_SRUN": mode, **extra},
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )


def _output(tmp_path: Path) -> str:
    return (tmp_path / "job.out").read_text()


def test_prints_the_base_url_once_healthy_and_passes_sigterm_on(fake_env, tmp_path):
    job = _start(fake_env, "serve", tmp_path)
    try:
        deadline = time.monotonic() + 30
        while "OpenAI base URL" not in _output(tmp_path):
            assert job.poll() is None, _output(tmp_path)
            assert time.monotonic() < deadline, _output(tmp_path)
            time.sleep(0.2)
        port = fake_env["MOESERVE_PORT"]
        assert f"OpenAI base URL: http://localhost:{port}/v1" in _output(tmp_path)
        job.send_signal(signal.SIGTERM)  # to the script only: it must reach "srun"
        assert job.wait(10) == 0, _output(tmp_path)
    finally:
        job.kill()
        job.wait()
    assert Path(fake_env["FAKE_SRUN_MARK"]).read_text() == "SIGTERM"
    text = _output(tmp_path)
    assert "got SIGTERM" in text and "srun exited with code 0" in text, text


def test_srun_failing_before_health_is_the_jobs_exit_code(fake_env, tmp_path):
    job = _start(fake_env, "exit3", tmp_path)
    assert job.wait(30) == 3, _output(tmp_path)
    assert "srun exited with code 3 before" in _output(tmp_path)


def test_gives_up_and_stops_srun_after_the_health_timeout(fake_env, tmp_path):
    job = _start(fake_env, "hang", tmp_path, MOESERVE_HEALTH_TIMEOUT="1")
    assert job.wait(30) == 1, _output(tmp_path)
    assert "did not answer 200 within 1s" in _output(tmp_path)


def test_refuses_to_run_outside_a_job(fake_env, tmp_path):
    env = {k: v for k, v in fake_env.items() if k != "SLURM_JOB_ID"}
    job = _start(env, "serve", tmp_path)
    assert job.wait(10) == 2
    assert "not inside a Slurm job" in _output(tmp_path)
