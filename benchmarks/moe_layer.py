"""One MoE layer of the benchmark model under expert parallelism, phase by phase.

Hidden 1024, 64 routed experts top-6 (sigmoid, 8 groups / top-4 groups, scaling 2.5), expert
FFN 512, one shared expert of FFN 512; fp32 random weights, the routed experts split evenly
over the EP ranks (contiguous placement). For EP 1, 2, 4 (local ranks, gloo, all-to-all
dispatcher; EP 1 the local one) and several tokens per rank it reports:

- the phases of the sequential step, each timed alone between barriers: gate/route,
  dispatch (+wait), experts, combine (+wait), shared expert;
- the whole step (gate included) with overlap off, overlap on (shared expert during the
  dispatch) and two-batch overlap, and what each overlap saves against off.

Each iteration starts after a barrier; its time is the slowest rank's; the table shows the
median of N. Experts run ``ops.moe.experts_sorted`` (the CPU kernel up to 64 rows a slot).

    python benchmarks/moe_layer.py [--ep 1 2 4] [--tokens 1 8 32 256] [--iters 20]
                                   [--threads N] [--out bench_out/moe_layer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from moeserve.distributed.ep import ExpertPlacement, ep_moe_forward, make_dispatcher  # noqa: E402
from moeserve.ops.cpu import fp32 as fp32_kernels  # noqa: E402
from moeserve.ops.linear import linear  # noqa: E402
from moeserve.ops.moe import experts_sorted  # noqa: E402
from moeserve.ops.routing import route_grouped_sigmoid  # noqa: E402
from tests.distributed.mp import run_ranks  # noqa: E402

D, E, K, FFN, N_GROUP, TOPK_GROUP, SCALING = 1024, 64, 6, 512, 8, 4, 2.5
PHASES = ("gate", "dispatch", "experts", "combine", "shared")
MODES = {"off": (False, False), "on": (True, False), "two_batch": (True, True)}


def build_layer(rank: int, placement: ExpertPlacement):
    """This rank's weights: router, its slots' experts, the shared expert (random, fp32)."""
    g = torch.Generator().manual_seed(0)
    router_ED = torch.randn(E, D, generator=g) * D**-0.5
    shared13 = torch.randn(2 * FFN, D, generator=g) * D**-0.5
    shared2 = torch.randn(D, FFN, generator=g) * FFN**-0.5
    S = placement.slots_per_rank
    g.manual_seed(1 + rank)
    w13_SFD = torch.randn(S, 2 * FFN, D, generator=g) * D**-0.5
    w2_SDF = torch.randn(S, D, FFN, generator=g) * FFN**-0.5
    bias_E = torch.zeros(E)

    def gate(x_TD):
        args = (linear(x_TD, router_ED), bias_E, K, N_GROUP, TOPK_GROUP, True, SCALING)
        return fp32_kernels.route_grouped_sigmoid(*args) or route_grouped_sigmoid(*args)

    def experts(x_RD, weight_R, slot_counts):
        return experts_sorted(x_RD, weight_R, list(slot_counts), w13_SFD, w2_SDF)

    def shared(x_TD):
        gate_, up = linear(x_TD, shared13).split(FFN, dim=-1)
        return linear(F.silu(gate_) * up, shared2)

    return gate, experts, shared


def phases_once(x_TD, gate, experts, shared, dispatcher, placement, group) -> list[float]:
    """The sequential step, each phase timed alone between barriers (so a phase's time does
    not include waiting for a slower rank's previous phase)."""
    times = []

    def timed(fn):
        dist.barrier(group)
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        return out

    topk_w_TK, topk_ids_TK = timed(lambda: gate(x_TD))
    d = timed(lambda: dispatcher.dispatch(x_TD, topk_w_TK, topk_ids_TK, placement).wait())
    y_RD = timed(lambda: experts(d.x_RD, d.weight_R, d.slot_counts) if len(d.x_RD) else d.x_RD)
    y_TD = timed(lambda: dispatcher.combine(y_RD, d.meta).wait())
    timed(lambda: shared(x_TD).add_(y_TD))
    return times


def worker(rank: int, ep: int, tokens: list[int], iters: int) -> dict:
    """Per tokens-per-rank: this rank's phase times and step times of every iteration."""
    group = dist.new_group(list(range(ep)))
    dispatcher = make_dispatcher("all_to_all", group) if ep > 1 else make_dispatcher("local")
    placement = ExpertPlacement.contiguous(E, ep)
    gate, experts, shared = build_layer(rank, placement)
    out = {}
    for T in tokens:
        n = iters if T <= 32 else max(5, iters // 2)
        g = torch.Generator().manual_seed(100 + rank)
        times = {k: [] for k in (*PHASES, *MODES)}
        for i in range(n + 2):  # two warm-up rounds; new tokens (so new experts) each round
            x_TD = torch.randn(T, D, generator=g)
            ph = phases_once(x_TD, gate, experts, shared, dispatcher, placement, group)
            for mode, (overlap, two_batch) in MODES.items():
                dist.barrier(group)
                t0 = time.perf_counter()
                topk_w_TK, topk_ids_TK = gate(x_TD)
                ep_moe_forward(
                    x_TD, topk_w_TK, topk_ids_TK, experts, shared, dispatcher, placement,
                    overlap=overlap, two_batch=two_batch,
                )  # fmt: skip
                if i >= 2:
                    times[mode].append(time.perf_counter() - t0)
            if i >= 2:
                for k, v in zip(PHASES, ph):
                    times[k].append(v)
        out[T] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="per rank; 0: cores // ranks, >= 1")
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "moe_layer.json"))
    args = ap.parse_args()

    cores = os.cpu_count() or 1
    cols = ("ep", "thr", "tok", *PHASES, "off", "on", "2batch", "save_on", "save_2b")
    print(f"MoE layer, median ms of the slowest rank; {cores} cores; savings vs off")
    print("".join(f"{c:>9}" for c in cols))
    rows = []
    for ep in args.ep:
        threads = args.threads or max(1, cores // ep)
        per_rank = run_ranks(
            worker, ep, args.tokens, args.iters, timeout=900, threads_per_rank=threads
        )
        for T in args.tokens:
            med = {
                k: 1e3 * statistics.median(max(ts) for ts in zip(*(r[T][k] for r in per_rank)))
                for k in per_rank[0][T]
            }
            row = dict(ep=ep, threads=threads, tokens_per_rank=T)
            row.update({f"{k}_ms": v for k, v in med.items()})
            row["saving_on_pct"] = 100 * (1 - med["on"] / med["off"])
            row["saving_two_batch_pct"] = 100 * (1 - med["two_batch"] / med["off"])
            rows.append(row)
            vals = [med[k] for k in (*PHASES, "off", "on", "two_batch")]
            print(
                f"{ep:>9}{threads:>9}{T:>9}"
                + "".join(f"{v:>9.2f}" for v in vals)
                + f"{row['saving_on_pct']:>8.0f}%{row['saving_two_batch_pct']:>8.0f}%"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        torch=torch.__version__,
        machine=platform.machine(),
        cores=cores,
        kernels=fp32_kernels.available(),
        command=" ".join(sys.argv),
        loadavg_at_end=os.getloadavg(),
    )
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
