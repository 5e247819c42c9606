"""Adaptive P/D against fixed prefill:decode splits on a load that changes phase, and the
planner's choice of split beside what is measured (issue 22, part 8).

Three one-thread instances of the benchmark model share this host's two cores (unpinned,
as the planner's ``--pd-colocated 3`` assumes), behind ``moeserve router``. The workload,
through ``moeserve bench serving``'s runner: ``--phase IN:OUT:RATE:SECONDS`` one after the
other (Poisson arrivals, RATE x SECONDS requests each, the next phase starting on time
whatever the last one left queued). The arms, each on freshly started instances:

- **fixed P:D** for every split 1:2 and 2:1;
- **auto-pd**: ``moeserve router --auto-pd`` starting from ``--auto-start`` (default 1:2,
  the split the first default phase suits worst), its targets the SLOs below.

Goodput is the planner's: the requests meeting both the TTFT and the TPOT SLO, per second of
the workload (the phases' durations added). The planner's prediction for the same phases
(``moeserve.planner.pd_ratio.predict_on_host``, profile ``--hardware``) is printed beside.

    python benchmarks/pd_phases.py [--phase 1024:4:0.45:120 --phase 64:128:1.2:120] \
        [--arms 1:2 2:1 auto] [--out bench_out/pd_phases.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_CONFIG, bench_model_path  # noqa: E402
from pd import host  # noqa: E402
from pd_instances import Cluster, model_id  # noqa: E402

from moeserve.bench.metrics import BenchmarkResult  # noqa: E402
from moeserve.bench.serving import ServingBenchConfig, run_benchmark  # noqa: E402
from moeserve.planner.pd_ratio import Phase, predict_on_host  # noqa: E402

_MOVED = re.compile(r"auto-pd: (\S+) moved from (\w+) to (\w+) in ([\d.]+) s")
ALL_CPUS = (0, 1)
# at 0.45 prompts/s the default 10-s window sees ~4 first tokens, fewer than the default 5
# a TTFT verdict needs
AUTO_ARGS = "--auto-pd-window 15 --auto-pd-min-samples 3 --auto-pd-cooldown 20"
LATENCY_KEYS = tuple(f"{s}_{m}_ms" for m in ("ttft", "tpot") for s in ("median", "p99"))


def parse_phase(text: str) -> tuple[int, int, float, float]:
    try:
        i, o, rate, secs = text.split(":")
        return int(i), int(o), float(rate), float(secs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected IN:OUT:RATE:SECONDS, got {text!r}") from None


def phase_config(args, url: str, model: str, i: int, phase) -> ServingBenchConfig:
    inp, out, rate, secs = phase
    return ServingBenchConfig(
        base_url=url,
        model=model,
        tokenizer=args.model,
        num_prompts=max(1, round(rate * secs)),
        random_input_len=inp,
        random_output_len=out,
        request_rate=rate,
        seed=10 + i,
        num_warmups=0,
        goodput={"ttft": args.ttft_ms, "tpot": args.tpot_ms},
        disable_tqdm=True,
    )


async def workload(configs: list[ServingBenchConfig], starts: list[float]) -> list:
    """Every phase's run, each started ``starts[i]`` s after the first."""

    async def at(delay: float, config: ServingBenchConfig) -> BenchmarkResult:
        await asyncio.sleep(delay)
        return await run_benchmark(config)

    return await asyncio.gather(*(at(s, c) for s, c in zip(starts, configs)))


def split_roles(split: str) -> list[str]:
    p, d = (int(x) for x in split.split(":"))
    return ["prefill"] * p + ["decode"] * d


def run_arm(args, arm: str) -> dict:
    auto = arm == "auto"
    roles = split_roles(args.auto_start if auto else arm)
    extra = ["--dtype", args.dtype, "--kv-cache-memory-gb", "0.5", "--max-num-seqs", "64"]
    router_extra = [] if not auto else [
        "--auto-pd",
        "--auto-pd-ttft-ms", str(args.ttft_ms),
        "--auto-pd-tpot-ms", str(args.tpot_ms),
        *args.auto_args.split(),
    ]  # fmt: skip
    with Cluster() as cluster:
        t0 = time.perf_counter()
        cluster.start_all(args.model, [(r, ALL_CPUS) for r in roles], extra, threads=1)
        router = cluster.route(router_extra)
        print(f"[{arm}] started in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        model = model_id(cluster.instances[0].url)
        for i, phase in enumerate(args.phase):  # warm-up: one request of each phase
            warm = phase_config(args, router.url, model, 100 + i, phase)
            asyncio.run(run_benchmark(dataclasses.replace(warm, num_prompts=1)))
        configs = [phase_config(args, router.url, model, i, p) for i, p in enumerate(args.phase)]
        starts = [sum(p[3] for p in args.phase[:i]) for i in range(len(args.phase))]
        t_run = time.perf_counter()
        results = asyncio.run(workload(configs, starts))
        took = time.perf_counter() - t_run
        switches = [
            {"url": m[1], "from": m[2], "to": m[3], "seconds": float(m[4]), "done_at_s": at}
            for at, line in router.lines_since(t_run)
            if (m := _MOVED.search(line))
        ]
    total_s = sum(p[3] for p in args.phase)
    phases = []
    for phase, r in zip(args.phase, results):
        d = r.to_dict()
        good = (r.request_goodput or 0.0) * r.duration
        phases.append(
            {
                "phase": "{}:{}:{:g}:{:g}".format(*phase),
                "requests": r.completed + r.failed,
                "failed": r.failed,
                "good": round(good),
                "goodput": good / phase[3],
                **{k: d[k] for k in LATENCY_KEYS},
            }
        )
    print(f"[{arm}] ran in {took:.0f} s; switches: {switches}", file=sys.stderr)
    return {
        "start": ":".join(str(roles.count(r)) for r in ("prefill", "decode")),
        "wall_s": took,
        "phases": phases,
        "goodput": sum(p["good"] for p in phases) / total_s,
        "failed": sum(p["failed"] for p in phases),
        "switches": switches,
    }


def predicted(args) -> dict:
    slo = {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms}
    pred = predict_on_host(
        {**BENCH_CONFIG, "model_type": "deepseek_v3"},
        [Phase(i, o, r, s, **slo) for i, o, r, s in args.phase],
        instances=3,
        hardware=args.hardware,
    )
    return pred.as_dict()


def print_table(results: dict, pred: dict) -> None:
    by_split = {s["split"]: s for s in pred["splits"]}
    names = [p["phase"] for p in next(iter(results.values()))["phases"]]
    print(
        "\n| arm | "
        + " | ".join(f"{n}: good/all, TTFT p50/p99 s, TPOT p50/p99 ms" for n in names)
        + " | goodput req/s | predicted | switches |"
    )
    print("|---" * (len(names) + 4) + "|")
    for arm, r in results.items():
        cells = [
            f"{p['good']}/{p['requests']}, {p['median_ttft_ms'] / 1e3:.1f}/"
            f"{p['p99_ttft_ms'] / 1e3:.1f}, {p['median_tpot_ms']:.0f}/{p['p99_tpot_ms']:.0f}"
            for p in r["phases"]
        ]
        split = by_split.get(arm)
        pg = f"{split['goodput']:.3f}" if split else "-"
        moves = ", ".join(
            f"{s['from']}->{s['to']} ({s['done_at_s'] - s['seconds']:.0f}-{s['done_at_s']:.0f} s)"
            for s in r["switches"]
        )
        row = " | ".join(cells)
        print(f"| {arm} | {row} | **{r['goodput']:.3f}** | {pg} | {moves or '-'} |")
    print(f"\nthe planner's best fixed split: {pred['best']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the benchmark model")
    ap.add_argument("--phase", type=parse_phase, action="append", default=None)
    ap.add_argument("--arms", nargs="+", default=["1:2", "2:1", "auto"])
    ap.add_argument("--auto-start", default="1:2", help="the split auto-pd starts from")
    ap.add_argument(
        "--auto-args",
        default=AUTO_ARGS,
        help="more router flags for the auto arm (default: a window that holds enough "
        "first tokens at under one request/s)",
    )
    ap.add_argument("--ttft-ms", type=float, default=15000.0)
    ap.add_argument("--tpot-ms", type=float, default=300.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hardware", default="this-machine", help="the planner's profile")
    ap.add_argument("--out", default="bench_out/pd_phases.json")
    args = ap.parse_args()
    args.phase = args.phase or [(1024, 4, 0.45, 120.0), (64, 128, 1.2, 120.0)]
    args.model = str(args.model or bench_model_path())
    for arm in args.arms:
        if arm != "auto":
            split_roles(arm)  # a bad split fails before anything starts

    pred = predicted(args)
    results = {arm: run_arm(args, arm) for arm in args.arms}
    print(f"\nhost: {host()}; model: {Path(args.model).name}, {args.dtype}, 3 x 1 thread")
    print_table(results, pred)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"host": host(), "args": vars(args), "predicted": pred, "results": results}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
