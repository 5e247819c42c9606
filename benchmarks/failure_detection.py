"""How fast a two-host service ends (or stops) after each event of issue 21: two ``moeserve
serve --ep 2 --nnodes 2`` processes on loopback (node 0 with the API, node 1 an agent for its
rank), one event, then the seconds until each node's ``serve`` exited, their exit codes, and
whether any process of either was left.

    python benchmarks/failure_detection.py [--repeat 3] [--out bench_out/failure_detection.json]

Events: ``kill_rank_b`` (kill -9 of node 1's rank: its agent reports it), ``kill_host_b``
(kill -9 of node 1's agent and rank: only the heartbeat tells), ``kill_engine_0`` (kill -9 of
node 0's engine process), ``term_0`` and ``term_b`` (SIGTERM to either node's ``serve``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from moeserve.demo import tiny_model_path

EVENTS = ("kill_rank_b", "kill_host_b", "kill_engine_0", "term_0", "term_b")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    tree: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        tree.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _start_pair(log_dir: Path) -> tuple[list[subprocess.Popen], str]:
    port, master = _free_port(), _free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "moeserve.cli", "serve", "--ep", "2", "--nnodes", "2"]
        cmd += ["--model", str(tiny_model_path())]
        cmd += ["--node-rank", str(node), "--master-addr", "127.0.0.1"]
        cmd += ["--master-port", str(master), "--log-level", "info"]
        if node == 0:
            cmd += ["--port", str(port)]
        log = open(log_dir / f"node{node}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a node exited while starting; logs in {log_dir}")
        announced = "serves the API at" in (log_dir / "node1.log").read_text()
        try:
            if announced and httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return procs, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the pair did not start; logs in {log_dir}")


def _trigger(event: str, procs: list[subprocess.Popen]) -> None:
    node0, node1 = procs
    if event == "kill_rank_b":
        os.kill(_descendants(node1.pid)[0], signal.SIGKILL)
    elif event == "kill_host_b":
        for pid in [*_descendants(node1.pid), node1.pid]:
            os.kill(pid, signal.SIGKILL)
    elif event == "kill_engine_0":
        engine = next(p for p in _descendants(node0.pid) if _is_engine(p))
        os.kill(engine, signal.SIGKILL)
    elif event == "term_0":
        node0.send_signal(signal.SIGTERM)
    elif event == "term_b":
        node1.send_signal(signal.SIGTERM)


def _is_engine(pid: int) -> bool:
    try:
        return b"engine_core" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def run_once(event: str, log_dir: Path) -> dict:
    procs, _ = _start_pair(log_dir)
    known = {p for proc in procs for p in (proc.pid, *_descendants(proc.pid))}
    t0 = time.monotonic()
    _trigger(event, procs)
    exit_s: list[float | None] = [None, None]
    while time.monotonic() - t0 < 120 and None in exit_s:
        for i, p in enumerate(procs):
            if exit_s[i] is None and p.poll() is not None:
                exit_s[i] = time.monotonic() - t0
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    time.sleep(1.0)
    left = sorted(p for p in known if _alive(p))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return {
        "event": event,
        "node0_exit_s": exit_s[0],
        "node1_exit_s": exit_s[1],
        "codes": [p.returncode for p in procs],
        "left_behind": len(left),
    }


def _host() -> dict:
    host = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            host["cpu"] = line.split(":", 1)[1].strip()
            break
    return host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--events", default=",".join(EVENTS))
    ap.add_argument("--out", default="bench_out/failure_detection.json")
    args = ap.parse_args()
    rows = []
    print(f"{'event':14} | node 0 exits after s | node 1 exits after s | exit codes | left")
    print(f"{'':14} |   median      max    |   median      max    |            |")
    for event in args.events.split(","):
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="moeserve-faildet-") as d:
                runs.append(run_once(event, Path(d)))
        n0 = [r["node0_exit_s"] for r in runs if r["node0_exit_s"] is not None]
        n1 = [r["node1_exit_s"] for r in runs if r["node1_exit_s"] is not None]
        codes = sorted({tuple(r["codes"]) for r in runs})
        left = sum(r["left_behind"] for r in runs)
        print(
            f"{event:14} | {statistics.median(n0):8.1f} {max(n0):8.1f}    "
            f"| {statistics.median(n1):8.1f} {max(n1):8.1f}    | {codes} | {left}",
            flush=True,
        )
        rows.extend(runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"host": _host(), "runs": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
