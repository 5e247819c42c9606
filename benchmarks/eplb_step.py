"""MoE step time under EP before and after an EPLB re-placement, on a skewed routing load.

One MoE layer shaped like the benchmark model's (hidden 1024, 64 experts top-6, sigmoid with
8 groups / top-4, expert FFN 512, a shared expert; fp32 random weights, expert ``e``'s
weights drawn from seed ``e`` so a moved expert is the same expert). A gate bias makes a few
experts hot, all of them on rank 0 under the contiguous placement. On ``--ep`` gloo ranks:

    1. contiguous placement (no redundancy): time the whole step (gate, dispatch, experts,
       combine, shared expert during the dispatch) ``--iters`` times; count the load
    2. ``rebalance_experts`` on the load summed over the ranks (``--redundant`` extra slots),
       then ``distributed/ep/migrate.move_experts`` moves the weights (timed)
    3. the same steps on the same tokens with the new placement (outputs compared)

A step's time is the slowest rank's; the table shows the median. ``rows max/mean`` is the
measured imbalance of the rows the ranks computed. Run from ``benchmarks/eplb.py --sources
step`` or alone:

    python benchmarks/eplb_step.py [--ep 4] [--tokens 32 256] [--iters 10] [--redundant 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from moeserve.distributed.ep import ExpertPlacement, ep_moe_forward, make_dispatcher  # noqa: E402
from moeserve.distributed.ep.migrate import move_experts  # noqa: E402
from moeserve.eplb import imbalance, rank_load, rebalance_experts  # noqa: E402
from moeserve.ops.cpu import fp32 as fp32_kernels  # noqa: E402
from moeserve.ops.linear import linear  # noqa: E402
from moeserve.ops.moe import experts_sorted  # noqa: E402
from moeserve.ops.routing import route_grouped_sigmoid  # noqa: E402
from tests.distributed.mp import run_ranks  # noqa: E402

D, E, K, FFN, N_GROUP, TOPK_GROUP, SCALING = 1024, 64, 6, 512, 8, 4, 2.5
HOT = (0, 1, 8, 9)  # groups 0 and 1: all on rank 0 of the contiguous placement at EP4


def expert_weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + e)
    w13 = torch.randn(2 * FFN, D, generator=g) * D**-0.5
    w2 = torch.randn(D, FFN, generator=g) * FFN**-0.5
    return w13, w2


def worker(rank: int, ep: int, tokens: list[int], iters: int, redundant: int, bias: float):
    group = dist.new_group(list(range(ep)))
    dispatcher = make_dispatcher("all_to_all", group)
    g = torch.Generator().manual_seed(0)
    router_ED = torch.randn(E, D, generator=g) * D**-0.5
    shared13 = torch.randn(2 * FFN, D, generator=g) * D**-0.5
    shared2 = torch.randn(D, FFN, generator=g) * FFN**-0.5
    bias_E = torch.zeros(E)
    bias_E[list(HOT)] = bias
    P = E + redundant
    # slots for P physical experts from the start, so the re-placement keeps the shapes:
    # before, the redundant slots hold copies of experts 0.. (the contiguous table)
    placement = ExpertPlacement.contiguous(E, ep, redundant)
    slots = placement.local_logical(rank)
    pairs = [expert_weights(e) for e in slots]
    experts = SimpleNamespace(
        w13_EFD=torch.stack([a for a, _ in pairs]), w2_EDF=torch.stack([b for _, b in pairs])
    )

    def gate(x_TD):
        args = (linear(x_TD, router_ED), bias_E, K, N_GROUP, TOPK_GROUP, True, SCALING)
        return fp32_kernels.route_grouped_sigmoid(*args) or route_grouped_sigmoid(*args)

    def run_experts(x_RD, weight_R, slot_counts):
        rows.append(len(x_RD))
        return experts_sorted(x_RD, weight_R, list(slot_counts), experts.w13_EFD, experts.w2_EDF)

    def shared(x_TD):
        gate_, up = linear(x_TD, shared13).split(FFN, dim=-1)
        return linear(F.silu(gate_) * up, shared2)

    def steps(T: int, placement: ExpertPlacement, load_E: torch.Tensor | None):
        gx = torch.Generator().manual_seed(100 + rank)
        times, outs = [], []
        for i in range(iters + 2):  # two warm-up rounds
            x_TD = torch.randn(T, D, generator=gx)
            dist.barrier(group)
            t0 = time.perf_counter()
            topk_w, topk_ids = gate(x_TD)
            y = ep_moe_forward(
                x_TD, topk_w, topk_ids, run_experts, shared, dispatcher, placement, overlap=True
            )
            if i >= 2:
                times.append(time.perf_counter() - t0)
                outs.append(y)
                if load_E is not None:
                    load_E += torch.bincount(topk_ids.flatten(), minlength=E)
        return times, outs

    out = {}
    for T in tokens:
        current = ExpertPlacement.contiguous(E, ep, redundant)
        if not torch.equal(current.phys2log_P, placement.phys2log_P):  # back to the start
            move_experts(experts, placement, current, rank, group)
            placement = current
        rows: list[int] = []
        load_E = torch.zeros(E, dtype=torch.int64)
        before, y_before = steps(T, placement, load_E)
        rows_before = sum(rows)
        dist.all_reduce(load_E, group=group)
        phy2log, _, _ = rebalance_experts(load_E.view(1, E), P, N_GROUP, 1, ep)
        new = placement.with_table(phy2log[0])
        dist.barrier(group)
        t0 = time.perf_counter()
        moved = move_experts(experts, placement, new, rank, group)
        move_s = time.perf_counter() - t0
        placement = new
        rows.clear()
        after, y_after = steps(T, placement, None)
        diff = max(float((a - b).abs().max()) for a, b in zip(y_before, y_after))
        contiguous_table = ExpertPlacement.contiguous(E, ep, redundant).phys2log_P.view(1, P)
        out[T] = dict(
            before=before,
            after=after,
            rows_before=rows_before,
            rows_after=sum(rows),
            move_s=move_s,
            moved_bytes=moved,
            max_abs_diff=diff,
            load=load_E.tolist(),
            predicted_before=float(imbalance(rank_load(load_E.view(1, E), contiguous_table, ep))),
            predicted_after=float(imbalance(rank_load(load_E.view(1, E), phy2log, ep))),
        )
    return out


def measure(ep: int, tokens: list[int], iters: int, redundant: int, bias: float) -> list[dict]:
    per_rank = run_ranks(
        worker, ep, tokens, iters, redundant, bias, timeout=1800, threads_per_rank=1
    )
    rows = []
    for T in tokens:
        rs = [r[T] for r in per_rank]
        med = {
            k: 1e3 * statistics.median(max(ts) for ts in zip(*(r[k] for r in rs)))
            for k in ("before", "after")
        }
        mean_rows = {k: sum(r[f"rows_{k}"] for r in rs) / ep for k in ("before", "after")}
        rows.append(
            dict(
                ep=ep,
                redundant=redundant,
                hot_bias=bias,
                tokens_per_rank=T,
                step_before_ms=med["before"],
                step_after_ms=med["after"],
                speedup=med["before"] / med["after"],
                rows_imbalance_before=max(r["rows_before"] for r in rs) / mean_rows["before"],
                rows_imbalance_after=max(r["rows_after"] for r in rs) / mean_rows["after"],
                predicted_before=rs[0]["predicted_before"],
                predicted_after=rs[0]["predicted_after"],
                move_ms=1e3 * max(r["move_s"] for r in rs),
                moved_mb=sum(r["moved_bytes"] for r in rs) / 2**20,
                max_abs_diff=max(r["max_abs_diff"] for r in rs),
            )
        )
    return rows


def print_rows(rows: list[dict]) -> None:
    cols = ("EP", "redund", "tok/rank", "bef ms", "aft ms", "speedup", "rows bef", "rows aft")
    cols += ("move ms", "moved MB", "max|dy|")
    print("MoE step, median ms of the slowest rank; rows = max/mean rows computed per rank")
    print("".join(f"{c:>10}" for c in cols))
    for r in rows:
        vals = (
            f"{r['ep']}",
            f"{r['redundant']}",
            f"{r['tokens_per_rank']}",
            f"{r['step_before_ms']:.1f}",
            f"{r['step_after_ms']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['rows_imbalance_before']:.2f}",
            f"{r['rows_imbalance_after']:.2f}",
            f"{r['move_ms']:.0f}",
            f"{r['moved_mb']:.0f}",
            f"{r['max_abs_diff']:.1e}",
        )
        print("".join(f"{v:>10}" for v in vals))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--redundant", type=int, default=4)
    ap.add_argument("--hot-bias", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "eplb_step.json"))
    args = ap.parse_args()
    rows = measure(args.ep, args.tokens, args.iters, args.redundant, args.hot_bias)
    print_rows(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
