"""Micro-benchmarks of this machine for ``moeserve plan calibrate``: memory bandwidth, GEMMs,
the routed-expert path and gloo collectives, with the fits that turn them into profile figures.
torch is imported inside the functions only."""

from __future__ import annotations

import socket
import statistics
import time

from moeserve.planner.calibrate.engine import TINY
from moeserve.planner.calibrate.host import cache_sizes, last_level_cache_mb

GEMM_SHAPES = [(1024, 1024), (2816, 1024), (1024, 2816), (4096, 1024)]  # (N, K)
GEMM_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def stream_bytes() -> int:
    """Bytes of weight copies to cycle so that none is still cached when its turn comes again:
    3x the last-level cache, at least 256 MiB (a 300 MB L3 holds a 256 MiB set whole)."""
    return max(256 << 20, int(3 * last_level_cache_mb(cache_sizes()) * 1e6))


def _copies(n: int, k: int, total: int) -> list:
    import torch

    w = torch.randn(n, k)
    return [w] + [w.clone() for _ in range(max(2, total // (4 * n * k)) - 1)]


def _best(fn, repeats: int, min_time: float = 0.05) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time:
                break
        best = min(best, dt / n)
    return best


def measure_gemms(threads: int) -> list[dict]:
    import torch

    from moeserve.ops.linear import linear

    torch.set_num_threads(threads)
    rows = []
    total = stream_bytes()
    with torch.inference_mode():
        for n, k in GEMM_SHAPES:
            # enough copies that the weights stream from memory, as a model's do (no copy is
            # still in the last-level cache when its turn comes again)
            ws = _copies(n, k, total)
            turn = iter(range(1 << 62))
            for m in GEMM_ROWS:
                x = torch.randn(m, k)

                def call(x=x, ws=ws, turn=turn):
                    return linear(x, ws[next(turn) % len(ws)])

                t = _best(call, 3)
                rows.append(dict(m=m, n=n, k=k, seconds=t))
            del ws
        w, x = torch.randn(16, 16), torch.randn(1, 16)
        tiny = _best(lambda: linear(x, w), 5)
    rows.append(dict(m=1, n=16, k=16, seconds=tiny, tiny=True))
    return rows


def measure_bandwidth(threads: int) -> dict[str, float]:
    import torch

    from moeserve.ops.linear import linear

    torch.set_num_threads(threads)
    total = max(1 << 30, stream_bytes())
    with torch.inference_mode():
        big = torch.ones(total // 4)
        t_sum = _best(big.sum, 3, 0.2)
        del big
        # 64 MiB weights cycled over 3x the last-level cache: a weight stream from memory
        ws, x = _copies(4096, 4096, total), torch.randn(1, 4096)
        turn = iter(range(1 << 62))
        t_gemv = _best(lambda: linear(x, ws[next(turn) % len(ws)]), 3, 0.2)
    return {"read_gbs": total / t_sum / 1e9, "gemv_gbs": 4096 * 4096 * 4 / t_gemv / 1e9}


def fit_gemm(rows: list[dict], bytes_per_s: float, op_s: float) -> tuple[float, float]:
    """(peak FLOP/s, m_half) minimising the median absolute log error of
    ``max(flops / (peak * m / (m + m_half)), bytes / bw) + op`` over the measured shapes
    (the median: a shape whose kernel path is off, or a burst of another tenant, does not
    drag the fit)."""
    import math

    data = [r for r in rows if not r.get("tiny")]
    top = max(2 * r["m"] * r["n"] * r["k"] / r["seconds"] for r in data)
    best = (float("inf"), top, 0.0)
    for p_scale in [0.6 + 0.02 * i for i in range(41)]:
        peak = top * p_scale
        for mh in [0.0] + [2 ** (i / 4) for i in range(0, 41)]:
            errs = []
            for r in data:
                m, n, k = r["m"], r["n"], r["k"]
                fl = 2 * m * n * k
                by = (n * k + m * k + m * n) * 4
                pred = max(fl / (peak * m / (m + mh)), by / bytes_per_s) + op_s
                errs.append(abs(math.log(pred / r["seconds"])))
            err = statistics.median(errs)
            if err < best[0]:
                best = (err, peak, mh)
    return best[1], best[2]


# ----------------------------------------------------------------------- collectives


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _coll_rank(rank: int, ws: int, port: int, iters: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    res: dict[str, list[float]] = {}
    cases = {}
    for nbytes in (4096, 65536, 16 << 20):
        n = max(ws, nbytes // 4 // ws * ws)
        x, y = torch.randn(n), torch.empty(n)
        cases[f"a2a_{nbytes}"] = lambda x=x, y=y: dist.all_to_all_single(y, x)
        cases[f"ar_{nbytes}"] = lambda x=x: dist.all_reduce(x)
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        ts = []
        for _ in range(iters if "16777216" not in name else max(5, iters // 4)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        res[name] = ts
    out.put((rank, res))
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(world_sizes=(2, 4), iters: int = 80) -> dict[int, dict[str, float]]:
    """Median over iterations of the slowest rank's time, seconds, per (op, bytes)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out: dict[int, dict[str, float]] = {}
    for ws in world_sizes:
        q = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_coll_rank, args=(r, ws, port, iters, q)) for r in range(ws)]
        for p in procs:
            p.start()
        per_rank = dict(q.get(timeout=300) for _ in range(ws))
        for p in procs:
            p.join(timeout=60)
        names = per_rank[0].keys()
        out[ws] = {
            name: statistics.median(max(ts) for ts in zip(*(per_rank[r][name] for r in range(ws))))
            for name in names
        }
    return out


def fit_latency(a2a_us: dict[int, float], cores: int) -> tuple[float, float, float]:
    """(alpha, beta, p) of ``alpha + beta (n - 1) + p * max(0, n - cores)`` from all-to-all
    latencies at 2 ranks and at a larger count. Ranks within the cores fit alpha + beta (n-1)
    by least squares (alpha 0 when only 2 ranks fit: one point cannot split the two); the
    largest oversubscribed count then gives p."""
    import numpy as np

    inside = sorted(n for n in a2a_us if n <= cores)
    if len(inside) >= 2:
        A = np.array([[1.0, n - 1] for n in inside])
        sol, *_ = np.linalg.lstsq(A, np.array([a2a_us[n] for n in inside]), rcond=None)
        alpha, beta = max(0.0, float(sol[0])), max(0.0, float(sol[1]))
    else:
        alpha, beta = 0.0, a2a_us[min(a2a_us)] / max(1, min(a2a_us) - 1)
    over = [n for n in a2a_us if n > cores]
    p = 0.0
    if over:
        n = max(over)
        p = max(0.0, (a2a_us[n] - alpha - beta * (n - 1)) / (n - cores))
    return alpha, beta, p


# ---------------------------------------------------------------------- the experts

EXPERT_SHAPE = dict(E=64, D=1024, F=512, K=6)
EXPERT_SETS = 4  # weight sets cycled (a few layers' worth: the footprint of a model)
EXPERT_TOKENS = [1, 4, 16, 64, 256, 512]


def measure_experts(threads: int) -> list[dict]:
    """Seconds of the engine's routed-expert computation (``ops.moe.moe_grouped``: the
    one-call CPU kernel for few rows, sorted grouped GEMMs for many) at uniform routing, with
    a shared expert as one more slot every token uses (as the engine runs DeepSeek without EP)
    and several layers' weights cycled."""
    import torch

    from moeserve.ops.moe import moe_grouped

    torch.set_num_threads(threads)
    E, D, F, K = (EXPERT_SHAPE[k] for k in ("E", "D", "F", "K"))
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        sets = [
            (torch.randn(E + 1, 2 * F, D) * 0.02, torch.randn(E + 1, D, F) * 0.02)
            for _ in range(EXPERT_SETS)
        ]
        shared = torch.tensor([E])
        for T in EXPERT_TOKENS:
            x = torch.randn(T, D)
            # a fresh routing each call, so the experts' weights come from memory as in a model
            routes = [
                torch.stack(
                    [torch.cat((torch.randperm(E, generator=g)[:K], shared)) for _ in range(T)]
                )
                for _ in range(16)
            ]
            w = torch.full((T, K + 1), 1.0 / (K + 1))
            turn = iter(range(1 << 62))

            def call(x=x, routes=routes, w=w, turn=turn):
                i = next(turn)
                w13, w2 = sets[i % len(sets)]
                return moe_grouped(x, w13, w2, w, routes[i % len(routes)])

            t = _best(call, 3, 0.1)
            rows.append(dict(tokens=T, seconds=t, **EXPERT_SHAPE))
    return rows


def fit_expert_efficiency(rows: list[dict], raw: dict) -> tuple[float, float]:
    """(expert_efficiency, expert_m_half) that make the cost model's routed-expert time (plus
    the shared expert's two GEMMs, another slot of the same kernel call here) match the
    measurements: the MoE kernel's own rate curve ``eff * peak * m / (m + m_half)`` over rows
    per expert, fitted by the median absolute log error on a grid (``raw``: the profile so
    far, as YAML data)."""
    import copy
    import math

    from moeserve.planner.cost_model import Rank, expert_gemm_path, gemm, routed_experts
    from moeserve.planner.hardware import profile_from_dict
    from moeserve.planner.layout import Layout
    from moeserve.planner.model_spec import spec_from_config

    specs = [
        spec_from_config(
            {
                **TINY,
                "hidden_size": r["D"],
                "moe_intermediate_size": r["F"],
                "n_routed_experts": r["E"],
                "num_experts_per_tok": r["K"],
                "n_group": 1,
                "topk_group": 1,
            },
            "experts",
        )
        for r in rows
    ]

    def error(eff: float, mh: float) -> float:
        r2 = copy.deepcopy(raw)
        r2["device"]["expert_efficiency"] = {"value": eff, "source": "fit"}
        r2["device"]["expert_m_half"] = {"value": mh, "source": "fit"}
        profile = profile_from_dict(r2, "calibration")
        rank = Rank.of(profile, Layout())
        errs = []
        for r, spec in zip(rows, specs):
            T, D, F = r["tokens"], r["D"], r["F"]
            pred = routed_experts(rank, spec, T).time_s
            # the shared slot: T rows as plain GEMMs where the call sends that many there,
            # else in blocks of the few-row path (the same kernel)
            if expert_gemm_path(rank, T):
                for n, k in ((2 * F, D), (D, F)):
                    pred += gemm(rank, "shared", T, n, k, large=True).time_s
            else:
                m = min(T, profile.device.small_gemm_max_rows or T)
                for n, k in ((2 * F, D), (D, F)):
                    pred += gemm(rank, "shared", m, n, k).time_s * T / m
            errs.append(abs(math.log(pred / r["seconds"])))
        return statistics.median(errs) + max(errs) / 4  # the median, and no count far off

    best = (float("inf"), 1.0, 0.0)
    for eff in [0.3 + 0.05 * i for i in range(35)]:
        for mh in [0.0] + [2 ** (i / 2) for i in range(0, 15)]:
            e = error(eff, mh)
            if e < best[0]:
                best = (e, eff, mh)
    return best[1], best[2]


# ------------------------------------------------------------------ prefill attention

# the benchmark model's MLA shapes (heads, latent, rope, nope, value dims)
ATTN_SHAPE = dict(H=16, C=256, R=32, N=64, V=64)
ATTN_TOKENS = [128, 512, 1024]


def measure_prefill_attention(threads: int) -> list[dict]:
    """Seconds of the engine's naive MLA prefill of one fresh prompt of L tokens
    (``layers.mla.MLAttention.forward_naive``: ``kv_b_proj`` expansion, then the causal
    attention of ``ops/prefill_attention.py``: the AVX-512 kernel, or the blocked form over
    concatenated keys), the projections around it excluded."""
    import math
    from types import SimpleNamespace

    import torch

    from moeserve.layers.mla import MLAttention
    from moeserve.ops.linear import linear

    torch.set_num_threads(threads)
    H, C, R, N, V = (ATTN_SHAPE[k] for k in ("H", "C", "R", "N", "V"))
    w = torch.randn(H * (N + V), C) * 0.05
    layer = SimpleNamespace(
        H=H, C=C, R=R, N=N, V=V, scale=1 / math.sqrt(N + R), kv_b_proj=lambda x: linear(x, w)
    )
    rows = []
    with torch.inference_mode():
        for L in ATTN_TOKENS:
            q = torch.randn(L, H, N + R)
            ctx = torch.randn(L, C + R)
            args = (layer, q, ctx)
            t = _best(lambda args=args: MLAttention.forward_naive(*args), 3, 0.1)
            rows.append(dict(tokens=L, seconds=t, **ATTN_SHAPE))
    return rows


def fit_attention_efficiency(rows: list[dict], profile) -> float:
    """The fraction of the GEMM path's rate at which the prefill attention core runs (its
    softmax, masking, copies and small per-head GEMMs included): for each prompt length, the
    cost model's core time at efficiency 1 over the measured time less its ``kv_b``
    expansion GEMM; the geometric mean, in (0, 1]."""
    import math

    from moeserve.planner.cost_model import Rank, attention_prefill, gemm
    from moeserve.planner.layout import Layout
    from moeserve.planner.model_spec import spec_from_config

    logs = []
    for r in rows:
        spec = spec_from_config(
            {
                **TINY,
                "num_attention_heads": r["H"],
                "num_key_value_heads": r["H"],
                "kv_lora_rank": r["C"],
                "qk_rope_head_dim": r["R"],
                "qk_nope_head_dim": r["N"],
                "v_head_dim": r["V"],
            },
            "attention",
        )
        rank = Rank.of(profile, Layout())
        L = r["tokens"]
        core = attention_prefill(rank, spec, 1, L, 0).time_s
        kv_b = gemm(rank, "kv_b", L, r["H"] * (r["N"] + r["V"]), r["C"]).time_s
        rest = max(r["seconds"] - kv_b, 1e-9)
        logs.append(math.log(core / rest))
    return min(1.0, math.exp(sum(logs) / len(logs)))
