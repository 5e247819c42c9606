"""What one hostile request does to everyone else: each of issue 20's probe bodies is sent to
a ``moeserve serve`` (the tiny random model) while a second client polls ``/health`` back to back;
the table gives the body's status and latency and the slowest and median ``/health`` answer
meanwhile (a server whose event loop is blocked answers ``/health`` only when it is free).

``--src A,B`` serves each checkout's code (e.g. a ``git worktree`` of an older commit beside
this one), one server at a time; the client is this checkout's. A server that has
``--trust-request-chat-template`` is started with it, so request templates reach the renderer
on both sides.

    python benchmarks/hostile_requests.py [--src DIR[,DIR...]] [--out bench_out/hostile.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from server_process import start_server

ROOT = Path(__file__).resolve().parents[1]
HI = [{"role": "user", "content": "hi"}]
LOOPS = (
    "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
    "{% endfor %}{% endfor %}{% endfor %}hi"
)


def bodies() -> list[tuple[str, str, bytes]]:
    """(label, path, raw JSON body)."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    items = [
        (
            "template: 3 nested range(1000)",
            chat,
            {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"chat_template": LOOPS}},
        ),
        (
            "template: 'hello world ' * 800000",
            chat,
            {"messages": HI, "max_tokens": 2, "chat_template": "{{ 'hello world ' * 800000 }}"},
        ),
        (
            "template: {{ 1/0 }}",
            chat,
            {"messages": HI, "max_tokens": 2, "chat_template": "{{ 1/0 }}"},
        ),
        ("prompt of 7.2 MB", comp, {"prompt": "hello world " * 600_000, "max_tokens": 1}),
        ("prompt of 9.6 MB", comp, {"prompt": "hello world " * 800_000, "max_tokens": 1}),
        ("100k chat messages", chat, {"messages": HI * 100_000, "max_tokens": 1}),
    ]
    out = [(label, path, json.dumps(body).encode()) for label, path, body in items]
    deep = b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": '
    out.append(("JSON nested 500 deep", chat, deep + b"[" * 500 + b"]" * 500 + b"}}"))
    return out


def start(src: Path) -> tuple[subprocess.Popen, str]:
    """A server of checkout ``src``, with ``--trust-request-chat-template`` where it has it."""
    env = dict(os.environ, PYTHONPATH=str(src))
    helptext = subprocess.run(
        [sys.executable, "-m", "moeserve.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=src,
    ).stdout
    trust = "--trust-request-chat-template"
    return start_server([trust] if trust in helptext else [], src)


def probe(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=300) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(f"{url}/health")
            out.append(time.perf_counter() - t0)
            time.sleep(0.01)


def measure(url: str, path: str, body: bytes) -> dict:
    stop, lat = threading.Event(), []
    t = threading.Thread(target=probe, args=(url, stop, lat), daemon=True)
    t.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    r = httpx.post(
        f"{url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=600
    )
    took = time.perf_counter() - t0
    time.sleep(0.2)
    stop.set()
    t.join(600)
    return {
        "status": r.status_code,
        "took_s": took,
        "health_max_s": max(lat),
        "health_p50_s": statistics.median(lat),
        "health_polls": len(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(ROOT), help="checkouts to serve, comma-separated")
    ap.add_argument("--out", default="bench_out/hostile.json")
    args = ap.parse_args()
    results = []
    for src in [Path(s).resolve() for s in args.src.split(",")]:
        proc, url = start(src)
        try:
            for label, path, body in bodies():
                row = {"src": str(src.name), "body": label, **measure(url, path, body)}
                results.append(row)
                print(
                    f"{row['src']:>14} | {label:36} | {row['status']} | {row['took_s']:7.2f} s"
                    f" | /health max {row['health_max_s']:7.3f} s, p50 {row['health_p50_s']:.3f} s",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait(120)
    host = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                host["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"host": host, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
