"""Prefill, decode and colocated ``moeserve serve`` instances, and ``moeserve router`` in front
of them, for the prefill/decode disaggregation tests (``test_pd_*.py``).

Every instance runs float32 on one thread with ``--enable-debug-endpoints``, so its outputs can
be compared with a colocated server's and its blocks checked through ``/debug/engine``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from tests.e2e.server import RunningServer, start_server
from tests.ports import free_port

COMMON = ("--dtype", "float32", "--threads", "1", "--enable-debug-endpoints")
_READY = re.compile(r"router ready at (http://[\d.]+:\d+)")


def colocated_args(model: str, *extra: str) -> tuple[str, ...]:
    return ("--model", model, *COMMON, *extra)


def prefill_args(model: str, *extra: str) -> tuple[str, ...]:
    return _role_args("prefill", model, *extra)


def decode_args(model: str, *extra: str) -> tuple[str, ...]:
    """A decode instance's flags; its bootstrap port (free now, and not the shared default)
    is the one it binds if adaptive P/D moves it to the prefill role."""
    return _role_args("decode", model, *extra)


def _role_args(role: str, model: str, *extra: str) -> tuple[str, ...]:
    return (
        *colocated_args(model, *extra),
        "--disaggregation-mode",
        role,
        "--disaggregation-bootstrap-port",
        str(free_port()),
    )


def start_servers(*arg_lists: Iterable[str]) -> list[RunningServer]:
    """``start_server(*args)`` for each list, all at once; if one fails, every one that started
    is killed and the first error raised."""
    with ThreadPoolExecutor(len(arg_lists)) as pool:
        futures = [pool.submit(start_server, *args) for args in arg_lists]
    started, errors = [], []
    for f in futures:
        try:
            started.append(f.result())
        except Exception as e:  # noqa: BLE001 - re-raised below, after the cleanup
            errors.append(e)
    if errors:
        for server in started:
            kill(server)
        raise errors[0]
    return started


def kill(server: RunningServer) -> None:
    """SIGKILL the server and its engine processes, and reap the server."""
    pids = server.engine_pids() if server.proc.poll() is None else []
    for pid in [server.proc.pid, *pids]:
        _kill(pid)
    server.proc.wait(30)
    for pid in pids:  # orphans of a killed server are re-parented: wait until they are gone
        _wait_gone(pid, 10)


def stop(server: RunningServer) -> None:
    """SIGTERM; SIGKILL for the server and its engine processes if they do not end in time
    (a finalizer: never raises)."""
    pids = server.engine_pids() if server.proc.poll() is None else []
    try:
        server.stop(timeout=30)  # SIGKILLs the server itself after the timeout
    except subprocess.TimeoutExpired:
        pass
    for pid in pids:
        if not _wait_gone(pid, 10):
            _kill(pid)
            _wait_gone(pid, 10)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int, timeout: float) -> bool:
    """Until ``pid`` has exited (a zombie counts); False after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return True
        time.sleep(0.05)
    return False


@dataclass
class Router:
    """A running ``moeserve router`` (which runs sglang-router as its child)."""

    proc: subprocess.Popen
    url: str = ""
    log: list[str] = field(default_factory=list)

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def text(self) -> str:
        return "".join(self.log)

    def stop(self) -> int:
        """SIGTERM (moeserve router forwards it and reaps sglang-router); SIGKILL of the
        group after 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)


def router_command(
    prefill: Iterable[str], decode: Iterable[str], port: int, *extra: str
) -> list[str]:
    """``moeserve router`` in front of the URLs, with ``extra`` flags (e.g. ``--auto-pd``)."""
    return [
        sys.executable,
        "-m",
        "moeserve.cli",
        "router",
        "--prefill",
        *prefill,
        "--decode",
        *decode,
        "--port",
        str(port),
        "--wait-timeout",
        "30",
        *extra,
    ]


def start_router(
    prefill: list[RunningServer],
    decode: list[RunningServer],
    *extra: str,
    timeout: float = 90.0,
) -> Router:
    """``moeserve router`` with the ``extra`` flags in front of the instances (in a process
    group of its own, with sglang-router); returns once it logs that every worker is
    registered. A router that finds its port taken (another process won the race for it) is
    started again on another."""
    for _ in range(3):
        router = _start_router(prefill, decode, extra, timeout)
        if router.url:
            return router
        if "Address already in use" not in router.text():
            break
    raise RuntimeError(f"moeserve router exited with {router.proc.returncode}:\n{router.text()}")


def _start_router(
    prefill: list[RunningServer],
    decode: list[RunningServer],
    extra: tuple[str, ...],
    timeout: float,
) -> Router:
    port = free_port(span=2)
    cmd = router_command([s.url for s in prefill], [s.url for s in decode], port, *extra)
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
            router.log.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _READY.search(router.text())
        if m:
            router.url = m.group(1)
            return router
        if proc.poll() is not None:
            reader.join(5)  # the whole log, with the reason
            return router
        time.sleep(0.1)
    router.stop()
    raise RuntimeError(f"moeserve router was not ready in {timeout}s:\n{router.text()}")


def router_workers(router: Router) -> dict[str, bool]:
    """Each instance the router lists (its URL) and whether the router counts it healthy."""
    listed = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
    return {w["url"].rstrip("/"): w["is_healthy"] for w in listed}


def engine_stats(server: RunningServer) -> dict:
    r = httpx.get(f"{server.url}/debug/engine", timeout=30)
    r.raise_for_status()
    return r.json()


def idle_problems(stats: dict) -> list[str]:
    """What keeps an instance from idle: blocks in use, a parked or running sequence, a
    failed KV self-check."""
    problems = []
    if stats["num_free_blocks"] != stats["num_blocks"]:
        problems.append(f"{stats['num_blocks'] - stats['num_free_blocks']} blocks in use")
    for key in ("num_parked", "num_running", "num_waiting"):
        if stats[key]:
            problems.append(f"{key} {stats[key]}")
    if stats["integrity"] != "ok":
        problems.append(f"integrity: {stats['integrity']}")
    if problems:  # what the instance is and what its transfers did, to tell a leak from a lag
        d = stats.get("disaggregation") or {}
        problems.append(f"role {d.get('role', 'colocated')}, transfers {d}")
    return problems


def wait_idle(servers: Iterable[RunningServer], timeout: float = 15.0) -> None:
    """Until every instance has every block free, nothing parked or running, and a KV
    self-check that passes; AssertionError naming what is left after ``timeout``."""
    servers = list(servers)
    deadline = time.monotonic() + timeout
    while True:
        left = {s.url: idle_problems(engine_stats(s)) for s in servers}
        left = {url: p for url, p in left.items() if p}
        if not left:
            return
        if time.monotonic() >= deadline:
            warned = {s.url: _warnings(s) for s in servers if s.url in left}
            raise AssertionError(f"not idle after {timeout:g} s: {left}\nwarnings: {warned}")
        time.sleep(0.2)


def _warnings(server: RunningServer, last: int = 12) -> list[str]:
    """The server's last warning and error lines (a failed transfer says why there), so a
    not-idle failure shows what the instance saw."""
    lines = [ln.rstrip() for ln in server.text().splitlines() if "WARNING" in ln or "ERROR" in ln]
    return lines[-last:]


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``check`` until it holds; the seconds it took. AssertionError after ``timeout``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.1)
    return time.monotonic() - start
