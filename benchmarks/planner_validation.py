"""The planner against the engine: decode-step and prefill-step time of the benchmark model on
this machine for EP 1, 2, 4 and TP 2, measured and predicted with the calibrated profile.

Measured: the engine (``LLM``, fp32, ranks spawned as in ``moeserve generate --ep N``), the
median time of ``engine.step()`` over steady decode steps with ``batch`` sequences on every
DP replica (the balanced DP-attention regime the planner models; a replica left idle would
give the busy one the whole machine), and the best of 3 prefill steps in which every DP
replica prefills one fresh ``prefill`` -token prompt. Each case is measured once per round,
the layouts in turn (``--rounds``, default 3), and keeps its best round: the machine's speed
drifts by tens of percent over minutes, and the calibration keeps the best of its repeats
too. Predicted: ``planner.simulator`` for the same layout, batch and context, with
``--hardware`` (default: the calibrated ``this-machine``).
Prints a table with the error of each case and every round's time, and writes JSON.

    python benchmarks/planner_validation.py [--layouts ep1,ep2,ep4,tp2] [--batches 1,8]
        [--prefill 512] [--rounds 3] [--hardware this-machine]
        [--out bench_out/planner_validation.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_CONFIG, bench_model_path  # noqa: E402

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.planner.calibrate.engine import time_decode_steps  # noqa: E402
from moeserve.planner.cost_model import Rank  # noqa: E402
from moeserve.planner.hardware import load_profile  # noqa: E402
from moeserve.planner.layout import Layout  # noqa: E402
from moeserve.planner.model_spec import spec_from_config  # noqa: E402
from moeserve.planner.simulator import decode_step, prefill_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 32
LAYOUTS = {
    "ep1": (dict(), Layout()),
    "ep2": (
        dict(data_parallel_size=2, enable_expert_parallel=True),
        Layout(dp=2, expert_parallel=True),
    ),
    "ep4": (
        dict(data_parallel_size=4, enable_expert_parallel=True),
        Layout(dp=4, expert_parallel=True),
    ),
    "tp2": (dict(tensor_parallel_size=2), Layout(tp=2)),
}


def _prompt(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(2, BENCH_CONFIG["vocab_size"], (n,), generator=g).tolist()


def measure_decode(llm: LLM, batch: int, steps: int, seed: int) -> float:
    """Median seconds of one decode step with ``batch`` sequences decoding (one run; the
    rounds of ``main`` repeat it)."""
    return time_decode_steps(llm, batch, PROMPT_LEN, steps, BENCH_CONFIG["vocab_size"], seed)


def measure_prefill(llm: LLM, prompts: int, n: int, seed: int, repeats: int = 3) -> float:
    """Best of ``repeats`` steps in which each of ``prompts`` requests prefills ``n`` fresh
    tokens."""
    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for r in range(repeats):
        for p in range(prompts):
            engine.add_request(f"p{seed}-{r}-{p}", _prompt(g, n), params)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return min(times)


def predict(profile, lay: Layout, kind: str, batch: int, ctx: float, n: int) -> dict:
    spec = spec_from_config({**BENCH_CONFIG, "model_type": "deepseek_v3"}, "bench-model")
    rank = Rank.of(profile, lay)
    if kind == "decode":
        step = decode_step(rank, spec, batch, ctx)
    else:
        step = prefill_step(rank, spec, 1, n)
    return {"seconds": step.time_s, "breakdown_ms": {k: v * 1e3 for k, v in step.breakdown.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="ep1,ep2,ep4,tp2")
    ap.add_argument("--batches", default="1,8", help="decode sequences per DP replica")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--hardware", default="this-machine")
    ap.add_argument(
        "--rounds", type=int, default=3, help="every case once per round, layouts in turn"
    )
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "planner_validation.json"))
    ap.add_argument(
        "--repredict",
        metavar="JSON",
        nargs="+",
        default=None,
        help="no engine: predict again the measured cases of earlier runs, each case's best "
        "(fastest) measurement over the runs; writes --out",
    )
    args = ap.parse_args()
    if args.repredict:
        rows = repredict(args.repredict, args.hardware)
        print(table(rows))
        meta = dict(hardware=args.hardware, runs=args.repredict, command=" ".join(sys.argv))
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.out}")
        return
    batches = [int(b) for b in args.batches.split(",")]
    profile = load_profile(args.hardware)
    model = str(bench_model_path())
    # every case once per round, the layouts in turn, so a slow phase of the machine (another
    # tenant: minutes long) touches every layout alike; each case keeps its best round, as the
    # calibration keeps the best of its repeats
    runs: dict[tuple, list[float]] = {}
    for rnd in range(args.rounds):
        for name in args.layouts.split(","):
            engine_kw, lay = LAYOUTS[name]
            llm = LLM(
                model=model,
                dtype="float32",
                progress=False,
                max_num_seqs=max(batches) * lay.dp,
                max_model_len=args.prefill + 64,
                max_num_batched_tokens=max(2048, args.prefill),
                enable_prefix_caching=False,
                **({"num_threads": os.cpu_count()} if lay.world == 1 else {}),
                **engine_kw,
            )
            try:
                measure_decode(llm, lay.dp, 4, seed=99)  # warm-up
                for b in batches:
                    t = measure_decode(llm, b * lay.dp, args.steps, seed=b + 100 * rnd)
                    runs.setdefault((name, "decode", b), []).append(t)
                measure_prefill(llm, lay.dp, 64, seed=7, repeats=1)  # warm-up
                t = measure_prefill(llm, lay.dp, args.prefill, seed=11 + rnd)
                runs.setdefault((name, "prefill", 1), []).append(t)  # 1 prompt per replica
            finally:
                llm.shutdown()
            print(f"round {rnd + 1}/{args.rounds}: {name} measured", flush=True)
    rows = []
    for (name, phase, b), times in runs.items():
        lay = LAYOUTS[name][1]
        if phase == "decode":
            ctx = PROMPT_LEN + args.steps / 2
            pred = predict(profile, lay, "decode", b, ctx, 0)
        else:
            ctx = args.prefill
            pred = predict(profile, lay, "prefill", lay.dp, 0, args.prefill)
        rows.append(
            dict(
                layout=name,
                phase=phase,
                batch=b,
                ctx=ctx,
                measured_s=min(times),
                measured_runs=times,
                predicted_s=pred["seconds"],
                breakdown_ms=pred["breakdown_ms"],
            )
        )
        print(_line(rows[-1]), flush=True)
    print()
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        torch=torch.__version__,
        machine=platform.machine(),
        cpus=os.cpu_count(),
        hardware=args.hardware,
        command=" ".join(sys.argv),
        date=time.strftime("%Y-%m-%d"),
    )
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


def repredict(paths: list[str], hardware: str) -> list[dict]:
    """The cases of earlier runs (each case's fastest measurement over them: a run that
    another tenant of the machine slowed loses), predicted again with today's cost model and
    profile."""
    profile = load_profile(hardware)
    best: dict[tuple, dict] = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            key = (r["layout"], r["phase"], r["batch"], r["ctx"])
            r = dict(
                r, measured_runs=best.get(key, {}).get("measured_runs", []) + [r["measured_s"]]
            )
            if key not in best or r["measured_s"] < best[key]["measured_s"]:
                best[key] = r
            else:
                best[key]["measured_runs"] = r["measured_runs"]
    rows = list(best.values())
    for r in rows:
        lay = LAYOUTS[r["layout"]][1]
        if r["phase"] == "decode":
            pred = predict(profile, lay, "decode", r["batch"], r["ctx"], 0)
        else:
            pred = predict(profile, lay, "prefill", 1, 0, r["ctx"])
        r["predicted_s"], r["breakdown_ms"] = pred["seconds"], pred["breakdown_ms"]
    return rows


def _err(r: dict) -> float:
    return (r["predicted_s"] - r["measured_s"]) / r["measured_s"]


def _line(r: dict) -> str:
    return (
        f"{r['layout']:<5}{r['phase']:<8} batch {r['batch']:>3}: measured "
        f"{r['measured_s'] * 1e3:8.2f} ms, predicted {r['predicted_s'] * 1e3:8.2f} ms "
        f"({100 * _err(r):+.0f}%)"
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| layout | step | sequences per DP replica | measured ms (best) | predicted ms | error "
        "| every round ms |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        what = r["phase"] if r["phase"] == "decode" else f"prefill {r['ctx']} tok/replica"
        each = ", ".join(f"{t * 1e3:.1f}" for t in r.get("measured_runs", [r["measured_s"]]))
        lines.append(
            f"| {r['layout']} | {what} | {r['batch']} | {r['measured_s'] * 1e3:.2f} | "
            f"{r['predicted_s'] * 1e3:.2f} | {100 * _err(r):+.0f}% | {each} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
