"""Start a ``moeserve serve`` for a benchmark and wait until it answers (shared by the
serving benchmarks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def start_server(
    args: list[str], src: Path | None = None, cpus: set[int] | None = None
) -> tuple[subprocess.Popen, str]:
    """``moeserve serve --port 0 ARGS``, from checkout ``src`` (its code on PYTHONPATH, run
    in it) or this interpreter's, on ``cpus`` (its CPU affinity, which the engine processes
    it starts inherit; None: this process's); returns ``(process, url)`` once /health
    answers 200. Its tracebacks and error lines go to this process's stderr."""
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", "--port", "0", "--log-level", "info"]
    if "--model" not in args:  # the tiny random model, as the benchmarks have always used
        from moeserve.demo import tiny_model_path

        cmd += ["--model", str(tiny_model_path())]
    env = None if src is None else dict(os.environ, PYTHONPATH=str(src))
    proc = subprocess.Popen(
        [*cmd, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=src,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    found: dict[str, str] = {}

    def pump() -> None:
        for line in proc.stderr:
            m = re.search(r"on (http://[\d.]+:\d+)", line)
            if m:
                found["url"] = m.group(1)
            if "Traceback" in line or line.startswith(("ERROR", "CRITICAL")):
                sys.stderr.write(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if "url" in found:
            try:
                if httpx.get(f"{found['url']}/health", timeout=2).status_code == 200:
                    return proc, found["url"]
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server{'' if src is None else f' of {src}'} did not start")
