"""What scraping ``/metrics`` costs generation: the same load with no scraper, with a scraper
as fast as one client goes, and with one at a fixed rate, alternating within one run, on one
``moeserve serve`` per checkout given (the tiny random model unless ``--model``).

``--src A,B`` serves each checkout's code (e.g. a ``git worktree`` of an older commit beside
this one), every server started once and left idle while another runs; the client side is
always this checkout's ``moeserve bench``. Every round runs each (checkout, mode) once, both
orders rotated from one round to the next so the host's drift hits all alike; each run gets
its own random prompts (seed = its position), so the prefix cache cannot serve one run from
another. The scraper is its own process (as a Prometheus would be) and only checks that each
answer is a 200. The table gives, per checkout and mode, output tokens/s (best and median
over the rounds), the median over the rounds of that run's tok/s over the same checkout's
no-scrape run of the same round, TTFT / ITL / E2E median and p99 (pooled over the rounds),
the scrapes per second reached, a scrape's own latency, and, where the server exports it,
how many stats snapshots the engine published per second meanwhile, and the CPU seconds the
engine process and the API server used in a run (the median over the rounds; every run
generates the same number of tokens, so the engine's is its cost per run), and what one scrape
cost each (the median over the rounds of the run's CPU over that round's no-scrape run, per
scrape; meaningful where scrapes are many: the tight loop).

    python benchmarks/metrics_scrape.py [--src DIR[,DIR...]] [--rounds 3] [--modes none,tight,8]
        [--num-prompts 48] [--input-len 64] [--output-len 64] [--max-concurrency 8]
        [--server-args "--max-num-seqs 16"] [--out bench_out/metrics_scrape.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server_process import start_server  # noqa: E402

from moeserve.bench.serving import ServingBenchConfig, run_benchmark  # noqa: E402

SNAPSHOTS = "moeserve:engine_stats_snapshots_total"


def scrape_loop(url: str, rate: float, stop, out) -> None:
    """GET /metrics until ``stop`` is set: back to back (rate inf) or every 1/rate s; puts
    ``(scrapes, failures, latencies_s)`` on ``out``."""
    gap = 0.0 if math.isinf(rate) else 1.0 / rate
    lat: list[float] = []
    failures = 0
    with httpx.Client(timeout=30) as c:
        due = time.perf_counter()
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = c.get(f"{url}/metrics").status_code == 200
            except httpx.HTTPError:
                ok = False
            lat.append(time.perf_counter() - t0)
            failures += not ok
            if gap:
                due += gap
                time.sleep(max(0.0, due - time.perf_counter()))
    out.put((len(lat), failures, lat))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pid(server_pid: int) -> int:
    """The engine process: the server's child (``python -m moeserve.serving.engine_core``)."""
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(server_pid)], capture_output=True, text=True
    ).stdout
    return next(int(line.split()[0]) for line in out.splitlines() if "engine_core" in line)


def snapshots(url: str) -> float | None:
    """The engine's published-snapshot counter, or None where the server has none."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(SNAPSHOTS):
            return float(line.rsplit(" ", 1)[1])
    return None


def run_mode(url: str, pids: tuple[int, int], mode: str, seed: int, args) -> dict:
    """One load run with the scraper of ``mode`` (``none``, ``tight`` or a rate per second)
    against the server at ``url`` whose API-server and engine processes are ``pids``."""
    config = ServingBenchConfig(
        seed=seed,
        base_url=url,
        num_prompts=args.num_prompts,
        random_input_len=args.input_len,
        random_output_len=args.output_len,
        request_rate=math.inf,
        max_concurrency=args.max_concurrency,
        num_warmups=1,
        disable_tqdm=True,
    )
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    scraper = None
    snaps0 = snapshots(url)
    if mode != "none":
        rate = math.inf if mode == "tight" else float(mode)
        scraper = ctx.Process(target=scrape_loop, args=(url, rate, stop, out), daemon=True)
        scraper.start()
    cpu0 = [cpu_seconds(p) for p in pids]
    t0 = time.perf_counter()
    result = asyncio.run(run_benchmark(config))
    took = time.perf_counter() - t0
    cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
    scrapes, failures, lat = 0, 0, []
    if scraper is not None:
        stop.set()
        scrapes, failures, lat = out.get(timeout=60)
        scraper.join(30)
    snaps1 = snapshots(url)
    rec = result.records
    return {
        "mode": mode,
        "seed": seed,
        "failed": result.failed,
        "output_throughput": result.output_throughput,
        "ttfts": [r.ttft for r in rec if r.success],
        "itls": [x for r in rec if r.success for x in r.itl],
        "e2els": [r.e2e for r in rec if r.success],
        "seconds": took,
        "api_cpu_s": cpu[0],
        "engine_cpu_s": cpu[1],
        "scrapes": scrapes,
        "scrape_failures": failures,
        "scrape_latencies": lat,
        "snapshots": None if snaps0 is None or snaps1 is None else snaps1 - snaps0,
    }


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else 0.0


def summarize(runs: list[dict], srcs: list[str], modes: list[str]) -> list[dict]:
    """One row per checkout and mode; the ratio is per round against that checkout's
    no-scrape run of the round."""
    base = {(r["src"], r["round"]): r for r in runs if r["mode"] == "none"}

    def per_scrape_ms(run: dict, key: str) -> float | None:
        """CPU ms a scrape cost: over this round's no-scrape run of the same checkout."""
        b = base.get((run["src"], run["round"]))
        if b is None or not run["scrapes"]:
            return None
        return (run[key] - b[key]) / run["scrapes"] * 1e3

    rows = []
    for src, mode in ((s, m) for s in srcs for m in modes):
        mine = [r for r in runs if r["mode"] == mode and r["src"] == src]
        tput = [r["output_throughput"] for r in mine]
        pooled = {k: [x for r in mine for x in r[k]] for k in ("ttfts", "itls", "e2els")}
        secs = sum(r["seconds"] for r in mine)
        snaps = [r["snapshots"] for r in mine]
        per_scrape = {}
        for key in ("engine_cpu_s", "api_cpu_s"):
            costs = [per_scrape_ms(r, key) for r in mine]
            costs = [c for c in costs if c is not None]
            per_scrape[key] = statistics.median(costs) if costs else None
        rows.append(
            {
                "src": src,
                "mode": mode,
                "tok_s_best": max(tput),
                "tok_s_median": statistics.median(tput),
                "ratio_per_round": [
                    r["output_throughput"] / base[src, r["round"]]["output_throughput"]
                    for r in mine
                    if (src, r["round"]) in base
                ],
                **{
                    f"{k[:-1]}_{q}_ms": pct(v, 50 if q == "p50" else 99)
                    for k, v in pooled.items()
                    for q in ("p50", "p99")
                },
                "scrapes_per_s": sum(r["scrapes"] for r in mine) / secs,
                "scrape_failures": sum(r["scrape_failures"] for r in mine),
                "scrape_p50_ms": pct([x for r in mine for x in r["scrape_latencies"]], 50),
                "snapshots_per_s": None if None in snaps else sum(snaps) / secs,
                "engine_cpu_s": statistics.median(r["engine_cpu_s"] for r in mine),
                "api_cpu_s": statistics.median(r["api_cpu_s"] for r in mine),
                **{f"{key[:-2]}_ms_per_scrape": per_scrape[key] for key in per_scrape},
                "failed_requests": sum(r["failed"] for r in mine),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        "| code | scraper | out tok/s best / median | vs none (median of rounds) "
        "| TTFT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms | scrapes/s | scrape p50 ms "
        "| snapshots/s | engine / API CPU s | engine / API CPU ms per scrape |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = statistics.median(r["ratio_per_round"]) if r["ratio_per_round"] else 1.0
        snaps = "n/a" if r["snapshots_per_s"] is None else f"{r['snapshots_per_s']:.2f}"
        mode = {"none": "none", "tight": "tight loop"}.get(r["mode"], f"{r['mode']}/s")
        per = "-"
        if r["engine_cpu_ms_per_scrape"] is not None:
            per = f"{r['engine_cpu_ms_per_scrape']:.1f} / {r['api_cpu_ms_per_scrape']:.1f}"
        print(
            f"| {r['src']} | {mode} | {r['tok_s_best']:.0f} / {r['tok_s_median']:.0f} "
            f"| {ratio:.2f} "
            f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
            f"| {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} "
            f"| {r['e2el_p50_ms']:.0f} / {r['e2el_p99_ms']:.0f} "
            f"| {r['scrapes_per_s']:.1f} | {r['scrape_p50_ms']:.1f} | {snaps} "
            f"| {r['engine_cpu_s']:.1f} / {r['api_cpu_s']:.1f} | {per} |"
        )


def describe(src: Path) -> str:
    """``commit`` of checkout ``src``, with ``+`` when its tracked files differ from it."""
    git = ["git", "-C", str(src)]
    rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return rev.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--src", default=str(ROOT), help="the moeserve checkouts to serve, comma-separated"
    )
    ap.add_argument("--model", default=None, help="a model directory (default: tiny)")
    ap.add_argument("--modes", default="none,tight,8", help="none, tight, or scrapes per second")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--server-args", default="--max-num-seqs 16", help="extra `serve` flags")
    ap.add_argument("--out", default="bench_out/metrics_scrape.json")
    args = ap.parse_args()
    modes = args.modes.split(",")
    trees = [Path(p).resolve() for p in args.src.split(",")]
    names = [f"{t.name}@{describe(t)}" for t in trees]
    server_args = args.server_args.split()
    if args.model:
        server_args += ["--model", args.model]
    servers: list[tuple[subprocess.Popen, str]] = []
    runs = []
    try:
        for t in trees:
            servers.append(start_server(server_args, t))
        seed = 0
        for r in range(args.rounds):
            k = r % len(modes)
            j = r % len(trees)
            for i in list(range(len(trees)))[j:] + list(range(len(trees)))[:j]:
                for mode in modes[k:] + modes[:k]:
                    proc, url = servers[i]
                    run = run_mode(url, (proc.pid, engine_pid(proc.pid)), mode, seed, args)
                    run["round"], run["src"] = r, names[i]
                    runs.append(run)
                    seed += 1
                    print(
                        f"round {r} {names[i]} {mode:>5}: {run['output_throughput']:.0f} "
                        f"tok/s, {run['scrapes']} scrapes in {run['seconds']:.1f} s",
                        file=sys.stderr,
                    )
    finally:
        for proc, _ in servers:
            proc.terminate()
        for proc, _ in servers:
            proc.wait(120)
    rows = summarize(runs, names, modes)
    for name, t in zip(names, trees):
        print(f"{name}: {t}")
    print_table(rows)
    meta = {
        "srcs": dict(zip(names, map(str, trees))),
        "host": platform.processor() or platform.machine(),
        "args": vars(args),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
