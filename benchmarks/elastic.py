"""What a rank loss costs an elastic-EP service (issue 23, part 6): the recovery split into
detection, group re-formation, expert reload and request recompute, and the tokens per second
before, during and after the loss.

One ``moeserve serve --ep N --enable-elastic-ep`` on this host (one thread per rank). S client
streams run back to back (greedy, ``ignore_eos``), each token's arrival timed. After
``--kill-after`` seconds rank ``--victim`` gets SIGKILL (or SIGSTOP: a hung rank, found by the
collective timeout). The server's recovery record (``/debug/engine``: ``elastic.history``)
gives when the survivors caught the failure and how long agreeing, joining and reloading
took; the streams give the rest:

    detection   kill -> the survivors' failed collective (the record's start)
    regroup     agreeing on the members + forming the new process group
    reload      reading the experts without a live copy from the checkpoint (slowest rank)
    recompute   end of the recovery -> each interrupted stream's next new token (its earlier
                tokens replayed one per step: median and max over the streams)
    gap         the longest pause a stream saw around the loss

    python benchmarks/elastic.py [--model bench|tiny|demo|DIR] [--ep 4] [--redundant 32] \
        [--streams 8] [--max-tokens 128] [--kill-after 20] [--run-after 20] \
        [--signal KILL|STOP] [--out bench_out/elastic.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import bench_model_path  # noqa: E402
from pd import host  # noqa: E402
from server_process import start_server  # noqa: E402


def model_dir(name: str) -> Path:
    """``bench`` (the benchmark model), ``tiny`` (the tiny random model), ``demo`` (the
    trained demo) or a directory."""
    from moeserve.demo import demo_model_path, tiny_model_path

    if name == "bench":
        return bench_model_path()
    if name in ("tiny", "demo"):
        return tiny_model_path() if name == "tiny" else demo_model_path()
    return Path(name)


def rank_pid(server_pid: int, rank: int) -> int:
    """The pid of launch rank ``rank`` among the server's descendants."""
    out = os.popen("ps -eo pid=,ppid=").read().split()
    children: dict[int, list[int]] = {}
    for pid, ppid in zip(out[::2], out[1::2]):
        children.setdefault(int(ppid), []).append(int(pid))
    todo = [server_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "moeserve.launch.worker" in cmd and f'"rank": {rank},' in cmd:
                return pid
    raise RuntimeError(f"no rank {rank} under pid {server_pid}")


class Streams:
    """S client streams back to back; every token's arrival (time.time()) per stream."""

    def __init__(self, url: str, model: str, num: int, max_tokens: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.arrivals: list[list[float]] = [[] for _ in range(num)]
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(num)]

    def start(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)

    def _run(self, i: int) -> None:
        body = {
            "model": self.model, "prompt": f"stream {i} says", "max_tokens": self.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
        }  # fmt: skip
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.errors.append(str(event["error"]))
                        elif event.get("choices") and event["choices"][0]["text"] is not None:
                            self.arrivals[i].append(time.time())


def tokens_per_s(arrivals: list[list[float]], start: float, end: float) -> float:
    n = sum(1 for a in arrivals for t in a if start <= t < end)
    return n / (end - start) if end > start else 0.0


def measure(args: argparse.Namespace, model_dir: Path) -> dict:
    server_args = [
        "--model", str(model_dir), "--ep", str(args.ep), "--enable-elastic-ep",
        "--ep-num-redundant-experts", str(args.redundant), "--threads", "1",
        "--enable-debug-endpoints", "--max-num-seqs", str(args.streams),
    ]  # fmt: skip
    proc, url = start_server(server_args)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        streams = Streams(url, model, args.streams, args.max_tokens).start()
        time.sleep(args.kill_after)
        victim = rank_pid(proc.pid, args.victim)
        killed_at = time.time()
        os.kill(victim, getattr(signal, f"SIG{args.signal}"))
        time.sleep(args.run_after)
        streams.finish()
        stats = httpx.get(f"{url}/debug/engine", timeout=60).json()
    finally:
        if args.signal == "STOP":
            os.kill(victim, signal.SIGKILL)
        proc.terminate()
        proc.wait(120)
    (rec,) = stats["elastic"]["history"]
    recovered_at = rec["started_at"] + rec["total_s"]
    resumed, gaps = [], []
    for a in streams.arrivals:
        after = [t for t in a if t >= recovered_at]
        before = [t for t in a if t < killed_at]
        if after and before:
            resumed.append(after[0] - recovered_at)
            gaps.append(after[0] - before[-1])
    back_at = recovered_at + max(resumed)
    end = killed_at + args.run_after
    return {
        "detection_s": rec["started_at"] - killed_at,
        "regroup_s": rec["agree_s"] + rec["join_s"],
        "agree_s": rec["agree_s"],
        "join_s": rec["join_s"],
        "reload_s": rec["reload_s"],
        "experts_reloaded": rec["experts_reloaded"],
        "bytes_read": rec["bytes_read"],
        "recovery_total_s": rec["total_s"],
        "recompute_median_s": statistics.median(resumed),
        "recompute_max_s": max(resumed),
        "gap_max_s": max(gaps),
        "tokens_per_s_before": tokens_per_s(
            streams.arrivals, killed_at - args.kill_after / 2, killed_at
        ),
        "tokens_per_s_during": tokens_per_s(streams.arrivals, killed_at, back_at),
        "tokens_per_s_after": tokens_per_s(streams.arrivals, back_at + 2, end),
        "live_ranks": stats["elastic"]["live_ranks"],
        "integrity": stats["integrity"],
        "stream_errors": streams.errors,
    }


def print_table(r: dict) -> None:
    reload = f"{r['experts_reloaded']} experts, {r['bytes_read'] / 1e6:.0f} MB"
    rows = [
        ("detection", f"{r['detection_s']:.2f} s"),
        (
            "regroup (agree + join)",
            f"{r['regroup_s']:.2f} s ({r['agree_s']:.2f} + {r['join_s']:.2f})",
        ),
        ("expert reload", f"{r['reload_s']:.2f} s ({reload})"),
        (
            "request recompute",
            f"median {r['recompute_median_s']:.2f} s, max {r['recompute_max_s']:.2f} s",
        ),
        ("longest stream pause", f"{r['gap_max_s']:.2f} s"),
        (
            "tokens/s before / during / after",
            " / ".join(f"{r[f'tokens_per_s_{k}']:.1f}" for k in ("before", "during", "after")),
        ),
        (
            "live ranks, KV self-check, stream errors",
            f"{r['live_ranks']}, {r['integrity']}, {len(r['stream_errors'])}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="bench", help="bench, tiny, demo or a directory")
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--redundant", type=int, default=32)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kill-after", type=float, default=20.0)
    p.add_argument("--run-after", type=float, default=20.0)
    p.add_argument("--victim", type=int, default=2, help="launch rank to kill (not 0)")
    p.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    p.add_argument("--out", default="bench_out/elastic.json")
    args = p.parse_args()
    result = measure(args, model_dir(args.model))
    print(
        f"elastic EP: {args.model}, --ep {args.ep}, {args.redundant} redundant, "
        f"{args.streams} streams, SIG{args.signal} of rank {args.victim}; host: {host()}"
    )
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "host": host(), **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
