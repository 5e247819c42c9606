"""Prefill, decode and colocated ``moeserve serve`` instances pinned to CPUs, and ``moeserve
router`` in front of the disaggregated ones, for the PD benchmarks (``pd.py``,
``pd_phases.py``).

An instance is pinned by starting its server with that CPU affinity: the engine processes it
spawns inherit it, and so do Mooncake's threads (``disagg/mooncake.py`` unpins them only to
the CPUs the process was started with), so "one core per instance" holds for everything the
instance runs.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx
from server_process import start_server

_READY = re.compile(r"router ready at (http://[\d.]+:\d+)")


def free_port() -> int:
    """A port on 127.0.0.1 free now (another process may still take it first: rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Instance:
    """One running ``moeserve serve``."""

    proc: subprocess.Popen
    url: str
    role: str  # "prefill", "decode" or "colocated"
    cpus: tuple[int, ...]

    def stop(self) -> None:
        _terminate(self.proc, 120)


def start_instance(
    model: str,
    role: str,
    cpus: Sequence[int],
    extra: Iterable[str] = (),
    threads: int | None = None,
) -> Instance:
    """``moeserve serve`` of ``model`` in ``role`` on ``cpus``, with ``threads`` intra-op
    threads (default: one per CPU)."""
    args = ["--model", model, "--threads", str(threads or len(cpus)), *extra]
    if role != "colocated":  # a decode instance binds its port if it becomes a prefill one
        args += ["--disaggregation-mode", role, "--disaggregation-bootstrap-port", str(free_port())]
    proc, url = start_server(args, cpus=set(cpus))
    return Instance(proc, url, role, tuple(cpus))


@dataclass
class Router:
    """A running ``moeserve router`` (with sglang-router as its child)."""

    proc: subprocess.Popen
    url: str = ""
    log: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.perf_counter() of each log line

    def text(self) -> str:
        return "".join(self.log)

    def lines_since(self, t0: float) -> list[tuple[float, str]]:
        """The log lines that came after ``t0`` (``time.perf_counter()``), with their time
        in seconds after it."""
        return [(t - t0, line) for t, line in zip(self.times, self.log) if t >= t0]

    def stop(self) -> None:
        _terminate(self.proc, 30, group=True)


def start_router(
    prefill: Sequence[str], decode: Sequence[str], extra: Iterable[str] = (), timeout: float = 120
) -> Router:
    """``moeserve router`` in front of the instance URLs; returns once it says it is ready.
    Its log lines are kept (``Router.text``) and the auto-PD ones echoed to stderr."""
    cmd = [
        sys.executable,
        "-m",
        "moeserve.cli",
        "router",
        "--prefill",
        *prefill,
        "--decode",
        *decode,
        "--port",
        str(free_port()),
        "--prometheus-port",
        str(free_port()),
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tempfile.gettempdir(),
        start_new_session=True,
    )
    router = Router(proc)

    def pump() -> None:
        for line in proc.stdout:
            router.times.append(time.perf_counter())
            router.log.append(line)
            if "auto-pd" in line:
                sys.stderr.write(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        m = _READY.search(router.text())
        if m:
            router.url = m.group(1)
            return router
        time.sleep(0.1)
    router.stop()
    raise RuntimeError(f"moeserve router did not start:\n{router.text()[-3000:]}")


class Cluster:
    """Instances and an optional router, all stopped on exit (each one at most once)."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self.instances: list[Instance] = []
        self.router: Router | None = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def add(self, instance: Instance) -> Instance:
        self.instances.append(instance)
        self._stack.callback(instance.stop)
        return instance

    def start_all(
        self,
        model: str,
        specs: Sequence[tuple[str, Sequence[int]]],
        extra: Iterable[str] = (),
        threads: int | None = None,
    ) -> None:
        """One instance per ``(role, cpus)``, started one after the other (each one loads
        its weights on its own CPUs)."""
        for role, cpus in specs:
            self.add(start_instance(model, role, cpus, extra, threads))

    def route(self, extra: Iterable[str] = ()) -> Router:
        prefill = [i.url for i in self.instances if i.role == "prefill"]
        decode = [i.url for i in self.instances if i.role == "decode"]
        self.router = start_router(prefill, decode, extra)
        self._stack.callback(self.router.stop)
        return self.router

    @property
    def url(self) -> str:
        """Where clients send requests: the router, or the one colocated instance."""
        if self.router is not None:
            return self.router.url
        (only,) = self.instances
        return only.url


def model_id(url: str) -> str:
    """The first model id the instance at ``url`` serves."""
    r = httpx.get(f"{url}/v1/models", timeout=10)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _terminate(proc: subprocess.Popen, timeout: float, group: bool = False) -> None:
    """SIGTERM, then SIGKILL (of the process group with ``group``) after ``timeout``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(30)
