"""Prefill/decode disaggregation against colocated serving under a mixed load, with the same
cores (issue 22, part 7).

The load, through ``moeserve bench serving``'s runner (``run_benchmark``, two at once):

- **decode streams**: ``--streams`` requests in flight at all times (``--rounds`` of them
  each), short prompts and long outputs: the users reading a stream;
- **prefill bursts**: ``--bursts`` long prompts with few output tokens, Poisson arrivals at
  ``--burst-rate`` from ``--burst-delay`` s after the streams start: the documents pasted in.

Each arm is measured twice in the same run: the decode streams alone (**undisturbed**), then
streams and bursts together (**mixed**), with other prompts (the prefix cache serves
neither from the other). The arms, on this host's first two CPUs:

- **colocated**: one instance on both cores (2 threads);
- **pd**: a prefill instance on core 0 and a decode instance on core 1 (1 thread each, the
  KV moved by Mooncake over loopback TCP), behind ``moeserve router`` (sglang-router).

This client and the router (its child) run on ``--client-cpus`` (default: CPU 0, the prefill
core; both cores hold the colocated instance). Left unpinned, they move to the decode core
whenever a prompt keeps the prefill core busy, and the decode streams lose a share of their
core to them: in one run on this host their ITL p99 went to 1.87x undisturbed that way,
against 1.20x pinned (a decode loop on core 1 runs its steps as fast with a prefill loop on
core 0 as without: the cores do not slow each other; ``docs/benchmarks.md``).

Goodput counts the requests that meet their class's SLO: a stream its TPOT and TTFT, a burst
its TTFT. The point of PD: the streams' ITL p99 in the mixed run within 1.2x of undisturbed,
where colocated's grows with every prompt chunk it runs beside them.

    python benchmarks/pd.py [--arms colocated pd] [--out bench_out/pd.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import bench_model_path  # noqa: E402
from pd_instances import Cluster, model_id  # noqa: E402

from moeserve.bench.metrics import BenchmarkResult  # noqa: E402
from moeserve.bench.serving import ServingBenchConfig, run_benchmark  # noqa: E402

ARMS = {
    "colocated": (("colocated", (0, 1)),),
    "pd": (("prefill", (0,)), ("decode", (1,))),
}


def host() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return model


def stream_config(args: argparse.Namespace, url: str, model: str, seed: int) -> ServingBenchConfig:
    return ServingBenchConfig(
        base_url=url,
        model=model,
        tokenizer=args.model,
        num_prompts=args.streams * args.rounds,
        random_input_len=args.stream_input_len,
        random_output_len=args.stream_output_len,
        max_concurrency=args.streams,
        seed=seed,
        num_warmups=0,
        goodput={"ttft": args.slo_stream_ttft_ms, "tpot": args.slo_tpot_ms},
        disable_tqdm=True,
    )


def burst_config(args: argparse.Namespace, url: str, model: str, seed: int) -> ServingBenchConfig:
    return ServingBenchConfig(
        base_url=url,
        model=model,
        tokenizer=args.model,
        num_prompts=args.bursts,
        random_input_len=args.burst_input_len,
        random_output_len=args.burst_output_len,
        request_rate=args.burst_rate,
        seed=seed,
        num_warmups=0,
        goodput={"ttft": args.slo_burst_ttft_ms},
        disable_tqdm=True,
    )


async def mixed(
    streams: ServingBenchConfig, bursts: ServingBenchConfig, delay_s: float
) -> tuple[BenchmarkResult, BenchmarkResult, float]:
    """Both loads at once, the bursts from ``delay_s`` after the streams; also returns the
    seconds both took together."""
    t0 = time.perf_counter()

    async def later() -> BenchmarkResult:
        await asyncio.sleep(delay_s)
        return await run_benchmark(bursts)

    s, b = await asyncio.gather(run_benchmark(streams), later())
    return s, b, time.perf_counter() - t0


def summary(r: BenchmarkResult) -> dict:
    d = r.to_dict()
    keep = (
        "completed",
        "failed",
        "duration",
        "request_goodput",
        "output_throughput",
        *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("median", "p99")),
    )
    out = {k: d[k] for k in keep}
    good = r.request_goodput * r.duration if r.request_goodput is not None else None
    out["good_requests"] = round(good) if good is not None else None
    return out


def run_arm(args: argparse.Namespace, arm: str) -> dict:
    extra = ["--dtype", args.dtype, "--max-num-seqs", "32", *args.server_args.split()]
    with Cluster() as cluster:
        t0 = time.perf_counter()
        cluster.start_all(args.model, ARMS[arm], extra)
        if arm == "pd":
            cluster.route()
        print(f"[{arm}] started in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        url = cluster.url
        model = model_id(cluster.instances[0].url)
        # warm-up: a burst and a round of streams, so neither timed run pays a first call
        warm = burst_config(args, url, model, seed=100)
        asyncio.run(run_benchmark(dataclasses.replace(warm, num_prompts=1)))
        asyncio.run(run_benchmark(stream_config(args, url, model, seed=101)))
        alone = asyncio.run(run_benchmark(stream_config(args, url, model, seed=1)))
        print(f"[{arm}] undisturbed: {alone.duration:.1f} s", file=sys.stderr)
        s, b, took = asyncio.run(
            mixed(
                stream_config(args, url, model, seed=2),
                burst_config(args, url, model, seed=3),
                args.burst_delay,
            )
        )
        print(f"[{arm}] mixed: {took:.1f} s", file=sys.stderr)
    last_burst = args.burst_delay + b.duration
    if last_burst > s.duration:
        print(
            f"[{arm}] note: the bursts ran until {last_burst:.1f} s, past the streams' "
            f"{s.duration:.1f} s: part of them met no stream",
            file=sys.stderr,
        )
    return {
        "undisturbed": summary(alone),
        "mixed_streams": summary(s),
        "mixed_bursts": summary(b),
        "itl_p99_ratio": s.itl.p99 / alone.itl.p99 if alone.itl.p99 else None,
        "good_requests_mixed": (summary(s)["good_requests"] or 0)
        + (summary(b)["good_requests"] or 0),
    }


def print_table(results: dict) -> None:
    def ms(d: dict, key: str) -> str:
        return f"{d[f'median_{key}_ms']:.0f} / {d[f'p99_{key}_ms']:.0f}"

    print(
        "\n| arm | run | done / failed | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| ITL p50 / p99 ms | goodput req/s (good) |"
    )
    print("|---|---|---|---|---|---|---|")
    for arm, r in results.items():
        for run in ("undisturbed", "mixed_streams", "mixed_bursts"):
            d = r[run]
            print(
                f"| {arm} | {run.replace('_', ' ')} | {d['completed']} / {d['failed']} "
                f"| {ms(d, 'ttft')} | {ms(d, 'tpot')} | {ms(d, 'itl')} "
                f"| {d['request_goodput']:.3f} ({d['good_requests']}) |"
            )
    print("\n| arm | streams' ITL p99: mixed / undisturbed | good requests in the mixed run |")
    print("|---|---|---|")
    for arm, r in results.items():
        ratio = r["itl_p99_ratio"]
        print(f"| {arm} | {ratio:.2f}x | {r['good_requests_mixed']} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the benchmark model")
    ap.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--server-args", default="", help="more `moeserve serve` flags, both arms")
    ap.add_argument("--streams", type=int, default=4, help="decode streams in flight")
    ap.add_argument("--rounds", type=int, default=3, help="requests per stream")
    ap.add_argument("--stream-input-len", type=int, default=64)
    ap.add_argument("--stream-output-len", type=int, default=160)
    ap.add_argument("--bursts", type=int, default=6, help="long prompts in the mixed run")
    ap.add_argument("--burst-input-len", type=int, default=1536)
    ap.add_argument("--burst-output-len", type=int, default=2)
    ap.add_argument("--burst-rate", type=float, default=0.2, help="long prompts per second")
    ap.add_argument("--burst-delay", type=float, default=2.0, help="s after the streams start")
    ap.add_argument("--slo-tpot-ms", type=float, default=150.0, help="a stream's TPOT SLO")
    ap.add_argument("--slo-stream-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--slo-burst-ttft-ms", type=float, default=15000.0)
    ap.add_argument("--client-cpus", default="0", help="this process and the router ('': unpinned)")
    ap.add_argument("--out", default="bench_out/pd.json")
    args = ap.parse_args()
    args.model = str(args.model or bench_model_path())
    if args.client_cpus:  # the instances set their own CPUs (pd_instances.start_instance)
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})

    results = {arm: run_arm(args, arm) for arm in args.arms}
    print(f"\nhost: {host()}; model: {Path(args.model).name}, {args.dtype}")
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"host": host(), "args": vars(args), "results": results}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
