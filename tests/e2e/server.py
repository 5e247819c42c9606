"""Start a real ``moeserve serve`` process for end-to-end tests and stop it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx

from moeserve.demo import tiny_model_path

_URL = re.compile(r"on (http://[\d.]+:\d+)")
API_KEY = "test-key"


@dataclass
class RunningServer:
    proc: subprocess.Popen
    url: str = ""
    log: list[str] = field(default_factory=list)

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def engine_pids(self) -> list[int]:
        """Every descendant process of the server (the engine and its ranks)."""
        out = subprocess.run(
            ["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True
        ).stdout
        children: dict[int, list[int]] = {}
        for line in out.splitlines():
            pid, ppid = map(int, line.split())
            children.setdefault(ppid, []).append(pid)
        found, todo = [], [self.proc.pid]
        while todo:
            for c in children.get(todo.pop(), []):
                found.append(c)
                todo.append(c)
        return found

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def text(self) -> str:
        return "".join(self.log)

    def stop_cleanly(self) -> None:
        """SIGTERM, then assert the server exited 0 and left no engine process behind."""
        code = self.stop()
        assert code == 0, self.text()
        assert not self.engine_pids()


def start_server(
    *args: str, timeout: float = 120.0, env: dict | None = None, builtin_demo: bool = False
) -> RunningServer:
    """``moeserve serve --port 0 ARGS``; returns once /health answers 200. Without
    ``--model`` in ARGS it serves the tiny random model, or with ``builtin_demo`` what a
    user gets without ``--model``: the trained demo."""
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", "--port", "0", "--log-level", "info"]
    if "--model" not in args and not builtin_demo:  # small and exact
        cmd += ["--model", str(tiny_model_path())]
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("MOESERVE_CACHE", os.environ.get("MOESERVE_CACHE", ""))
    if not full_env["MOESERVE_CACHE"]:
        del full_env["MOESERVE_CACHE"]
    proc = subprocess.Popen(
        [*cmd, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=tempfile.gettempdir(),
    )
    server = RunningServer(proc)

    def pump() -> None:
        for line in proc.stdout:
            server.log.append(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            time.sleep(0.2)
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.text()}")
        m = _URL.search(server.text())
        if m:
            server.url = m.group(1)
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not start in {timeout}s:\n{server.text()}")
