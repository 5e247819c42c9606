"""``moeserve plan calibrate``: measure this machine and write a hardware profile.

Micro-benchmarks, each the engine's own path where it has one (best of repeats: the machine
may be shared):
  memory      a full read of a tensor and a 1-row GEMM (the engine's kernel) over weights
              cycled through 3x the last-level cache (at least 1 GiB) -> the better of the two
              as the peak, the GEMM's as the weight stream's efficiency;
  GEMMs       ``moeserve.ops.linear.linear`` (the few-row CPU kernel, else MKL) over rows
              1..1024 of model-sized weights cycled through 3x the last-level cache -> peak
              FLOP/s and ``gemm_m_half`` (median-error fit of the cost model's GEMM formula)
              of each path: the kernel's rows (``small_gemm_*``) and MKL's; the per-call
              overhead;
  experts     ``layers.moe.moe_grouped`` at 1..512 tokens, 64 experts top-6 plus a shared
              slot, several layers' weights cycled -> ``expert_efficiency`` (against the
              few-row path's GEMMs of the same rows per expert);
  attention   ``MLAttention.forward_naive`` (latent expansion, blocked causal attention) at
              128-1024 tokens -> ``prefill_attention_efficiency``;
  collectives all_to_all and all_reduce over gloo among 2 and 4 processes
              (torch.multiprocessing) -> link bandwidth, and the barrier-synchronised latencies
              for reference;
  the engine  decode steps of a tiny DeepSeek-V3 (hidden 64) in one process with 2 and 8
              layers at batch 1, 4, 16 -> step, layer and sequence overheads (the measured
              step less the cost model's compute); and under TP 2, EP 2 and EP 4 -> the cost
              of a collective as the engine issues it (back to back, between Python, with
              gloo's threads on the same cores) and the wait of ranks beyond the cores.

torch is imported here only, inside the functions: the rest of the planner stays torch-free.
"""

from __future__ import annotations

import json
import os
from datetime import date
from pathlib import Path
from typing import Any

from moeserve.planner.calibrate.engine import (
    _compute_only,
    fit_engine_collectives,
    fit_overheads,
    measure_engine,
    measure_engine_layouts,
)
from moeserve.planner.calibrate.host import describe_host
from moeserve.planner.calibrate.micro import (
    fit_attention_efficiency,
    fit_expert_efficiency,
    fit_gemm,
    fit_latency,
    measure_bandwidth,
    measure_collectives,
    measure_experts,
    measure_gemms,
    measure_prefill_attention,
)

__all__ = ["build_profile", "read_measurements", "write_profile"]


def numa_domains() -> int:
    """NUMA nodes Linux reports (1 where it reports none)."""
    try:
        nodes = [d for d in os.listdir("/sys/devices/system/node") if d[4:].isdigit()]
    except OSError:
        return 1
    return max(1, sum(1 for d in nodes if d.startswith("node")))


def _fig(value: Any, source: str) -> dict:
    if isinstance(value, float):
        value = float(f"{value:.4g}")
    return {"value": value, "source": source}


def kernel_variant() -> str:
    """Which fp32 kernels the engine runs here (the calibration times those)."""
    import torch

    from moeserve.ops.cpu import kernels

    mkl = "MKL" if torch.backends.mkl.is_available() else "torch"
    if not kernels.available():
        return f"torch reference for few rows (no compiled kernels), {mkl} for many"
    isa = "AVX-512F" if kernels.wide() else "AVX2+FMA"
    return (
        f"ops/cpu/kernels.c {isa} for <= {kernels.MAX_ROWS} rows and the MoE, {mkl} for more rows"
    )


def kernel_max_rows() -> int:
    """Rows up to which ``linear`` runs the engine's own kernel (0: MKL for every count)."""
    from moeserve.ops.cpu import kernels

    return kernels.MAX_ROWS if kernels.available() else 0


def expert_gemm_min_rows() -> int:
    """Rows from which the engine's MoE call runs an expert as MKL GEMMs here (0: never, or
    no kernels)."""
    from moeserve.ops.cpu import kernels

    return (kernels.mkl_min_rows() or 0) if kernels.available() else 0


def build_profile(threads: int | None = None, log=print, refit: dict | None = None) -> dict:
    """Run every micro-benchmark and return the profile as YAML-ready data. ``refit``: the
    ``measurements`` and ``measured_on`` of an earlier calibration (:func:`read_measurements`)
    to fit again with today's cost model instead of measuring."""
    import torch

    from moeserve.planner.hardware import profile_from_dict

    cores = len(os.sched_getaffinity(0))
    threads = threads or cores
    meas = (refit or {}).get("measurements", {})
    if refit:
        host = refit["measured_on"]
        today = host["date"]
    else:
        today = date.today().isoformat()
        host = describe_host(today, str(torch.__version__), kernel_variant())
    cal = f"calibrated: moeserve plan calibrate, {today}, {host['cpu_model']}"
    log(f"{host['cpu_model']} ({host['cpu_id']}), {cores} CPUs, kernels: {host['engine_kernels']}")
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    numa = numa_domains()

    log(f"memory bandwidth ({threads} threads) ...")
    bw = meas["bandwidth"] if refit else measure_bandwidth(threads)
    log(f"  read {bw['read_gbs']:.1f} GB/s, 1-row GEMM stream {bw['gemv_gbs']:.1f} GB/s")
    log("GEMMs ...")
    gemms = meas["gemms"] if refit else measure_gemms(threads)
    op_s = next(r["seconds"] for r in gemms if r.get("tiny"))
    # two paths: the engine's kernel up to its row limit, MKL beyond; each fitted alone
    small_rows = kernel_max_rows()
    many = [r for r in gemms if not small_rows or r["m"] > small_rows or r.get("tiny")]
    peak, m_half = fit_gemm(many, bw["gemv_gbs"] * 1e9, op_s)
    log(f"  fp32 peak {peak / 1e9:.1f} GFLOP/s, m_half {m_half:.1f}, call {op_s * 1e6:.1f} us")
    small_peak, small_half = 0.0, 0.0
    if small_rows:
        few = [r for r in gemms if r["m"] <= small_rows and not r.get("tiny")]
        small_peak, small_half = fit_gemm(few, bw["gemv_gbs"] * 1e9, op_s)
        log(
            f"  few-row kernel (<= {small_rows} rows): peak {small_peak / 1e9:.1f} GFLOP/s, "
            f"m_half {small_half:.1f}"
        )
    log("collectives over gloo (2 and 4 processes) ...")
    coll = {int(k): v for k, v in meas["collectives"].items()} if refit else measure_collectives()
    # the cost model's form, at 4 KiB (a decode step's messages): all-to-all
    # alpha + beta (n - 1) + p * max(0, n - cores), a ring all-reduce alpha_ar + 2 beta (n - 1)
    lat, per_peer, over = fit_latency({n: coll[n]["a2a_4096"] * 1e6 for n in coll}, cores)
    ar_lat = max(0.0, coll[2]["ar_4096"] * 1e6 - 2 * per_peer)
    big = 16 << 20
    t_big = coll[2][f"a2a_{big}"] - coll[2]["a2a_4096"]
    link_gbs = (big / 2) / max(t_big, 1e-9) / 1e9
    log(
        f"  all_to_all {lat:.0f} us + {per_peer:.0f} us/peer, all_reduce {ar_lat:.0f} us, "
        f"{over:.0f} us per rank beyond the cores, {link_gbs:.2f} GB/s"
    )
    raw = {
        "name": "this-machine",
        "kind": "cpu",
        "description": (
            f"this machine, measured by `moeserve plan calibrate` on {today}: "
            f"{host['cpu_model']}, {cores} cores, torch {torch.__version__}, fp32 engine "
            f"kernels ({host['engine_kernels']}), gloo on loopback"
        ),
        "measured_on": host,
        "node": {
            "devices": _fig(numa, f"{cal}: NUMA domains (/sys/devices/system/node), one rank each")
        },
        "device": {
            "matmul_tflops": {
                "fp32": _fig(peak / 1e12, f"{cal}: fitted to {len(many) - 1} GEMMs (MKL rows)")
            },
            "matmul_efficiency": _fig(1.0, f"{cal}: the fitted peak is what GEMMs reach"),
            "gemm_m_half": _fig(m_half, f"{cal}: fitted to the GEMMs of the MKL rows"),
            "small_gemm_max_rows": _fig(
                small_rows, "moeserve/ops/cpu/kernels.py: MAX_ROWS (0: no compiled kernels)"
            ),
            "small_gemm_tflops": _fig(
                small_peak / 1e12, f"{cal}: fitted to the GEMMs of rows 1..{small_rows}"
            ),
            "small_gemm_m_half": _fig(
                small_half, f"{cal}: fitted to the GEMMs of rows 1..{small_rows}"
            ),
            "expert_gemm_min_rows": _fig(
                expert_gemm_min_rows(),
                "moeserve/ops/cpu/kernels.py: mkl_min_rows() here (0: never, or no kernels)",
            ),
            "expert_efficiency": _fig(1.0, "placeholder, fitted below"),
            # the engine's weights stream through its own kernel: what a 1-row GEMM over
            # weights beyond the last-level cache reaches is the rate that counts (the better
            # of it and a torch sum is the peak)
            "memory_bandwidth_gbs": _fig(
                max(bw["read_gbs"], bw["gemv_gbs"]),
                f"{cal}: the better of a sum over, and a 1-row GEMM streaming, weights of 3x "
                "the last-level cache",
            ),
            "memory_efficiency": _fig(
                bw["gemv_gbs"] / max(bw["read_gbs"], bw["gemv_gbs"]),
                f"{cal}: 1-row GEMM (the engine's kernel) weight stream / the peak",
            ),
            "memory_gb": _fig(mem_gb / numa, f"{cal}: physical memory (sysconf) / NUMA domains"),
            "cores": _fig(max(1, cores // numa), f"{cal}: usable CPUs / NUMA domains"),
        },
        "network": {
            "intra_node": {
                "latency_us": _fig(lat, f"{cal}: gloo all_to_all of 4 KiB, 2-4 ranks"),
                "allreduce_latency_us": _fig(ar_lat, f"{cal}: gloo all_reduce of 4 KiB, 2 ranks"),
                "per_peer_us": _fig(per_peer, f"{cal}: gloo all_to_all of 4 KiB, 2-4 ranks"),
                "bandwidth_gbs": _fig(link_gbs, f"{cal}: gloo all_to_all of 16 MiB, 2 ranks"),
            },
            "inter_node": {
                "latency_us": _fig(lat, "assumption: one host; as inside the node"),
                "allreduce_latency_us": _fig(ar_lat, "assumption: one host; as inside the node"),
                "per_peer_us": _fig(per_peer, "assumption: one host; as inside the node"),
                "bandwidth_gbs": _fig(link_gbs, "assumption: one host; as inside the node"),
            },
        },
        "software": {
            "step_overhead_us": _fig(0.0, "placeholder, fitted below"),
            "layer_overhead_us": _fig(0.0, "placeholder, fitted below"),
            "seq_overhead_us": _fig(0.0, "placeholder, fitted below"),
            "seq_layer_overhead_us": _fig(0.0, "placeholder, fitted below"),
            "op_overhead_us": _fig(op_s * 1e6, f"{cal}: a 1x16x16 linear call"),
            "collective_overhead_us": _fig(0.0, f"{cal}: inside the link latency"),
            "oversubscription_us": _fig(
                over, f"{cal}: gloo all_to_all of 4 KiB among 2-4 ranks on {cores} cores"
            ),
            "dispatch_collectives": _fig(
                2, "moeserve/distributed/ep/all_to_all.py: row counts, then rows"
            ),
            "control_collectives": _fig(
                4,
                "moeserve/launch/engine_group.py: broadcast_json and all_gather_json of "
                "each step, 2 collectives each",
            ),
            "comm_overlaps_compute": _fig(
                False, "docs/benchmarks.md: gloo's threads take the cores the experts need"
            ),
            "weight_dtype": _fig("fp32", "the engine's dtype on this CPU (benchmarks: fp32)"),
            "compute_dtype": _fig("fp32", "the engine's dtype on this CPU (benchmarks: fp32)"),
            "kv_dtype": _fig("fp32", "the engine's dtype on this CPU (benchmarks: fp32)"),
            "dispatch_dtype": _fig("fp32", "moeserve dispatch sends rows in the compute dtype"),
            "memory_reserve_fraction": _fig(0.1, "assumption: OS, Python and torch"),
        },
    }
    log("routed experts (the engine's grouped MoE path, 64 experts of 1024 x 512, top-6) ...")
    moe = meas["experts"] if refit else measure_experts(threads)
    eff, e_half = fit_expert_efficiency(moe, raw)
    src = f"{cal}: moeserve moe_grouped at 1-512 tokens, the kernel's rate curve fitted"
    raw["device"]["expert_efficiency"] = _fig(eff, src)
    raw["device"]["expert_m_half"] = _fig(e_half, src)
    log(f"  {eff:.2f} of the few-row peak, half of that at {e_half:.1f} rows per expert")
    log("prefill attention (the engine's naive MLA prefill, 128-1024 tokens) ...")
    attn = meas.get("prefill_attention") if refit else measure_prefill_attention(threads)
    if attn:
        a_eff = fit_attention_efficiency(attn, profile_from_dict(raw, "calibration"))
        a_src = (
            f"{cal}: MLAttention.forward_naive at 128-1024 tokens, less its kv_b GEMM, "
            "against the GEMM fit"
        )
    else:  # a refit of a calibration from before this measurement existed
        a_eff, a_src = 1.0, "assumption: not measured in the calibration refitted"
    raw["device"]["prefill_attention_efficiency"] = _fig(a_eff, a_src)
    log(f"  the attention core at {a_eff:.2f} of the GEMM rate")
    log("engine overheads (tiny DeepSeek, 2 and 8 layers, batch 1, 4 and 16) ...")
    eng = meas["engine_steps"] if refit else measure_engine(threads)
    profile = profile_from_dict(raw, "calibration")
    step, layer, seq, seq_layer = fit_overheads(eng, lambda r: _compute_only(profile, r))
    src = f"{cal}: decode steps of a tiny DeepSeek minus the cost model's compute, fitted"
    raw["software"]["step_overhead_us"] = _fig(step, src)
    raw["software"]["layer_overhead_us"] = _fig(layer, src)
    raw["software"]["seq_overhead_us"] = _fig(seq, src)
    raw["software"]["seq_layer_overhead_us"] = _fig(seq_layer, src)
    log(
        f"  step {step:.0f} us, layer {layer:.1f} us, sequence {seq:.1f} us, "
        f"sequence x layer {seq_layer:.2f} us"
    )
    log("collectives inside the engine (tiny DeepSeek under TP 2, EP 2, EP 4) ...")
    lay_rows = meas["engine_layouts"] if refit else measure_engine_layouts()
    a2a, ar, over = fit_engine_collectives(lay_rows, raw)
    src = (
        f"{cal}: decode steps of a tiny DeepSeek under TP 2, EP 2, EP 4 "
        "(collectives as the engine issues them), fitted"
    )
    for level in ("intra_node", "inter_node"):
        net = raw["network"][level]
        how = src if level == "intra_node" else "assumption: one host; as inside the node"
        net["latency_us"] = _fig(a2a, how)
        net["allreduce_latency_us"] = _fig(ar, how)
        net["per_peer_us"] = _fig(0.0, f"{cal}: inside latency_us (2 and 4 ranks only here)")
    raw["software"]["oversubscription_us"] = _fig(over, src)
    log(
        f"  all-to-all {a2a:.0f} us, all-reduce {ar:.0f} us, {over:.0f} us per rank beyond "
        f"the cores (the micro-benchmark alone: {lat:.0f} + {per_peer:.0f} us/peer, "
        f"all-reduce {ar_lat:.0f} us)"
    )
    raw["measurements"] = {
        "bandwidth": bw,
        "gemms": gemms,
        "collectives": {str(k): v for k, v in coll.items()},
        "experts": moe,
        "prefill_attention": attn,
        "engine_steps": eng,
        "engine_layouts": lay_rows,
    }
    profile_from_dict(raw, "calibration")  # the result loads
    return raw


def read_measurements(path: str | Path) -> dict:
    """The ``measured_on`` section and the raw measurements (the commented JSON line) of a
    profile written by :func:`write_profile`."""
    import yaml

    text = Path(path).read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    lines = [ln[2:] for ln in text.splitlines() if ln.startswith("# {")]
    if not lines or "measured_on" not in raw:
        raise ValueError(f"{path}: no raw measurements or measured_on section to fit again")
    return {"measured_on": raw["measured_on"], "measurements": json.loads(lines[-1])}


def write_profile(raw: dict, path: str | Path) -> Path:
    import yaml

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    meas = raw.pop("measurements", None)
    text = "# written by `moeserve plan calibrate`; every figure says how it was measured\n"
    text += yaml.safe_dump(raw, sort_keys=False, width=100)
    if meas is not None:
        text += "# raw measurements (not read by the planner)\n"
        text += "\n".join("# " + line for line in json.dumps(meas).splitlines()) + "\n"
    out.write_text(text, encoding="utf-8")
    return out
