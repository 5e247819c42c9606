"""``build_profile``: one calibration as a sequence of stages. Each stage logs what it runs,
measures (or takes the earlier calibration's measurements when refitting), fits the cost
model's figures and writes them into the profile, every figure with its source::

    _start                     the host, the CPUs, the threads
    _memory_stage              bandwidth: a full read and a 1-row GEMM stream
    _gemm_stage                GEMM peaks and m_half: the few-row kernel's rows and MKL's
    _collectives_stage         gloo all_to_all / all_reduce latencies and link bandwidth
    _base_profile              the profile so far (device, network, software sections)
    _experts_stage             expert_efficiency, expert_m_half
    _attention_stage           prefill_attention_efficiency
    _overheads_stage           step, layer and sequence overheads of the engine
    _engine_collectives_stage  collective latencies as the engine issues them

torch is imported inside the functions only: the rest of the planner stays torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import Any

from moeserve.planner.calibrate.engine import (
    _compute_only,
    fit_engine_collectives,
    fit_overheads,
    measure_engine,
    measure_engine_layouts,
)
from moeserve.planner.calibrate.host import (
    describe_host,
    expert_gemm_min_rows,
    kernel_max_rows,
    kernel_variant,
    numa_domains,
)
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


def _fig(value: Any, source: str) -> dict:
    if isinstance(value, float):
        value = float(f"{value:.4g}")
    return {"value": value, "source": source}


@dataclass(frozen=True)
class _Calibration:
    """What every stage of one calibration shares."""

    threads: int
    cores: int
    today: str
    host: dict  # the ``measured_on`` section
    torch_version: str
    log: Callable[[str], object]
    # the raw measurements of an earlier calibration to fit again; None: measure now
    earlier: dict | None

    @property
    def cal(self) -> str:
        """The start of every calibrated figure's source."""
        return f"calibrated: moeserve plan calibrate, {self.today}, {self.host['cpu_model']}"

    def measure(self, key: str, measure: Callable[[], Any]) -> Any:
        """``measure()``, or the earlier calibration's ``key`` when fitting again."""
        return self.earlier[key] if self.earlier is not None else measure()


@dataclass(frozen=True)
class _GemmFit:
    rows: list  # the measurements
    op_s: float  # one tiny call: the per-call overhead
    small_rows: int  # rows up to which the engine's kernel runs (0: MKL for all)
    num_fitted: int  # GEMMs of MKL's rows the peak was fitted to
    peak: float
    m_half: float
    small_peak: float
    small_half: float


@dataclass(frozen=True)
class _LinkFit:
    by_size: dict[int, dict]  # the measurements, by process count
    lat: float
    per_peer: float
    over: float
    ar_lat: float
    link_gbs: float


def build_profile(threads: int | None = None, log=print, refit: dict | None = None) -> dict:
    """Run every micro-benchmark and return the profile as YAML-ready data. ``refit``: the
    ``measurements`` and ``measured_on`` of an earlier calibration (:func:`read_measurements`)
    to fit again with today's cost model instead of measuring."""
    from moeserve.planner.hardware import profile_from_dict

    run = _start(threads, log, refit)
    bw = _memory_stage(run)
    gemm = _gemm_stage(run, bw)
    link = _collectives_stage(run)
    raw = _base_profile(run, bw, gemm, link)
    moe = _experts_stage(run, raw)
    attn = _attention_stage(run, raw)
    eng = _overheads_stage(run, raw)
    lay_rows = _engine_collectives_stage(run, raw, link)
    raw["measurements"] = {
        "bandwidth": bw,
        "gemms": gemm.rows,
        "collectives": {str(k): v for k, v in link.by_size.items()},
        "experts": moe,
        "prefill_attention": attn,
        "engine_steps": eng,
        "engine_layouts": lay_rows,
    }
    profile_from_dict(raw, "calibration")  # the result loads
    return raw


def _start(threads: int | None, log, refit: dict | None) -> _Calibration:
    """This machine's CPUs and host description (the earlier one's when refitting)."""
    import torch

    cores = len(os.sched_getaffinity(0))
    if refit:
        host = refit["measured_on"]
        today = host["date"]
    else:
        today = date.today().isoformat()
        host = describe_host(today, str(torch.__version__), kernel_variant())
    run = _Calibration(
        threads=threads or cores,
        cores=cores,
        today=today,
        host=host,
        torch_version=str(torch.__version__),
        log=log,
        earlier=refit.get("measurements", {}) if refit else None,
    )
    log(f"{host['cpu_model']} ({host['cpu_id']}), {cores} CPUs, kernels: {host['engine_kernels']}")
    return run


def _memory_stage(run: _Calibration) -> dict:
    run.log(f"memory bandwidth ({run.threads} threads) ...")
    bw = run.measure("bandwidth", lambda: measure_bandwidth(run.threads))
    run.log(f"  read {bw['read_gbs']:.1f} GB/s, 1-row GEMM stream {bw['gemv_gbs']:.1f} GB/s")
    return bw


def _gemm_stage(run: _Calibration, bw: dict) -> _GemmFit:
    """Two paths: the engine's kernel up to its row limit, MKL beyond; each fitted alone."""
    run.log("GEMMs ...")
    gemms = run.measure("gemms", lambda: measure_gemms(run.threads))
    op_s = next(r["seconds"] for r in gemms if r.get("tiny"))
    small_rows = kernel_max_rows()
    many = [r for r in gemms if not small_rows or r["m"] > small_rows or r.get("tiny")]
    peak, m_half = fit_gemm(many, bw["gemv_gbs"] * 1e9, op_s)
    run.log(f"  fp32 peak {peak / 1e9:.1f} GFLOP/s, m_half {m_half:.1f}, call {op_s * 1e6:.1f} us")
    small_peak, small_half = 0.0, 0.0
    if small_rows:
        few = [r for r in gemms if r["m"] <= small_rows and not r.get("tiny")]
        small_peak, small_half = fit_gemm(few, bw["gemv_gbs"] * 1e9, op_s)
        run.log(
            f"  few-row kernel (<= {small_rows} rows): peak {small_peak / 1e9:.1f} GFLOP/s, "
            f"m_half {small_half:.1f}"
        )
    return _GemmFit(gemms, op_s, small_rows, len(many) - 1, peak, m_half, small_peak, small_half)


def _collectives_stage(run: _Calibration) -> _LinkFit:
    """The cost model's form, at 4 KiB (a decode step's messages): all-to-all
    alpha + beta (n - 1) + p * max(0, n - cores), a ring all-reduce alpha_ar + 2 beta (n - 1);
    the link bandwidth from 16 MiB."""
    run.log("collectives over gloo (2 and 4 processes) ...")
    if run.earlier is not None:
        coll = {int(k): v for k, v in run.earlier["collectives"].items()}
    else:
        coll = measure_collectives()
    lat, per_peer, over = fit_latency({n: coll[n]["a2a_4096"] * 1e6 for n in coll}, run.cores)
    ar_lat = max(0.0, coll[2]["ar_4096"] * 1e6 - 2 * per_peer)
    big = 16 << 20
    t_big = coll[2][f"a2a_{big}"] - coll[2]["a2a_4096"]
    link_gbs = (big / 2) / max(t_big, 1e-9) / 1e9
    run.log(
        f"  all_to_all {lat:.0f} us + {per_peer:.0f} us/peer, all_reduce {ar_lat:.0f} us, "
        f"{over:.0f} us per rank beyond the cores, {link_gbs:.2f} GB/s"
    )
    return _LinkFit(coll, lat, per_peer, over, ar_lat, link_gbs)


def _base_profile(run: _Calibration, bw: dict, gemm: _GemmFit, link: _LinkFit) -> dict:
    """The profile from the micro-benchmarks so far; the later stages fit its placeholders."""
    numa = numa_domains()
    return {
        "name": "this-machine",
        "kind": "cpu",
        "description": (
            f"this machine, measured by `moeserve plan calibrate` on {run.today}: "
            f"{run.host['cpu_model']}, {run.cores} cores, torch {run.torch_version}, fp32 engine "
            f"kernels ({run.host['engine_kernels']}), gloo on loopback"
        ),
        "measured_on": run.host,
        "node": {
            "devices": _fig(
                numa, f"{run.cal}: NUMA domains (/sys/devices/system/node), one rank each"
            )
        },
        "device": _device_section(run, numa, bw, gemm),
        "network": _network_section(run, link),
        "software": _software_section(run, gemm, link),
    }


def _device_section(run: _Calibration, numa: int, bw: dict, gemm: _GemmFit) -> dict:
    cal, small_rows = run.cal, gemm.small_rows
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return {
        "matmul_tflops": {
            "fp32": _fig(gemm.peak / 1e12, f"{cal}: fitted to {gemm.num_fitted} GEMMs (MKL rows)")
        },
        "matmul_efficiency": _fig(1.0, f"{cal}: the fitted peak is what GEMMs reach"),
        "gemm_m_half": _fig(gemm.m_half, f"{cal}: fitted to the GEMMs of the MKL rows"),
        "small_gemm_max_rows": _fig(
            small_rows, "moeserve/ops/cpu/fp32.py: MAX_ROWS (0: no compiled kernels)"
        ),
        "small_gemm_tflops": _fig(
            gemm.small_peak / 1e12, f"{cal}: fitted to the GEMMs of rows 1..{small_rows}"
        ),
        "small_gemm_m_half": _fig(
            gemm.small_half, f"{cal}: fitted to the GEMMs of rows 1..{small_rows}"
        ),
        "expert_gemm_min_rows": _fig(
            expert_gemm_min_rows(),
            "moeserve/ops/cpu/fp32.py: mkl_min_rows() here (0: never, or no kernels)",
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
        "cores": _fig(max(1, run.cores // numa), f"{cal}: usable CPUs / NUMA domains"),
    }


def _network_section(run: _Calibration, link: _LinkFit) -> dict:
    cal, same = run.cal, "assumption: one host; as inside the node"
    return {
        "intra_node": {
            "latency_us": _fig(link.lat, f"{cal}: gloo all_to_all of 4 KiB, 2-4 ranks"),
            "allreduce_latency_us": _fig(link.ar_lat, f"{cal}: gloo all_reduce of 4 KiB, 2 ranks"),
            "per_peer_us": _fig(link.per_peer, f"{cal}: gloo all_to_all of 4 KiB, 2-4 ranks"),
            "bandwidth_gbs": _fig(link.link_gbs, f"{cal}: gloo all_to_all of 16 MiB, 2 ranks"),
        },
        "inter_node": {
            "latency_us": _fig(link.lat, same),
            "allreduce_latency_us": _fig(link.ar_lat, same),
            "per_peer_us": _fig(link.per_peer, same),
            "bandwidth_gbs": _fig(link.link_gbs, same),
        },
    }


def _software_section(run: _Calibration, gemm: _GemmFit, link: _LinkFit) -> dict:
    cal, dtype_src = run.cal, "the engine's dtype on this CPU (benchmarks: fp32)"
    return {
        "step_overhead_us": _fig(0.0, "placeholder, fitted below"),
        "layer_overhead_us": _fig(0.0, "placeholder, fitted below"),
        "seq_overhead_us": _fig(0.0, "placeholder, fitted below"),
        "seq_layer_overhead_us": _fig(0.0, "placeholder, fitted below"),
        "op_overhead_us": _fig(gemm.op_s * 1e6, f"{cal}: a 1x16x16 linear call"),
        "collective_overhead_us": _fig(0.0, f"{cal}: inside the link latency"),
        "oversubscription_us": _fig(
            link.over, f"{cal}: gloo all_to_all of 4 KiB among 2-4 ranks on {run.cores} cores"
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
        "weight_dtype": _fig("fp32", dtype_src),
        "compute_dtype": _fig("fp32", dtype_src),
        "kv_dtype": _fig("fp32", dtype_src),
        "dispatch_dtype": _fig("fp32", "moeserve dispatch sends rows in the compute dtype"),
        "memory_reserve_fraction": _fig(0.1, "assumption: OS, Python and torch"),
    }


def _experts_stage(run: _Calibration, raw: dict) -> list:
    """``expert_efficiency`` and ``expert_m_half``: the grouped MoE path's rate curve."""
    run.log("routed experts (the engine's grouped MoE path, 64 experts of 1024 x 512, top-6) ...")
    moe = run.measure("experts", lambda: measure_experts(run.threads))
    eff, e_half = fit_expert_efficiency(moe, raw)
    src = f"{run.cal}: moeserve moe_grouped at 1-512 tokens, the kernel's rate curve fitted"
    raw["device"]["expert_efficiency"] = _fig(eff, src)
    raw["device"]["expert_m_half"] = _fig(e_half, src)
    run.log(f"  {eff:.2f} of the few-row peak, half of that at {e_half:.1f} rows per expert")
    return moe


def _attention_stage(run: _Calibration, raw: dict) -> list | None:
    """``prefill_attention_efficiency``: the naive MLA prefill against the GEMM fit."""
    from moeserve.planner.hardware import profile_from_dict

    run.log("prefill attention (the engine's naive MLA prefill, 128-1024 tokens) ...")
    if run.earlier is not None:
        attn = run.earlier.get("prefill_attention")
    else:
        attn = measure_prefill_attention(run.threads)
    if attn:
        a_eff = fit_attention_efficiency(attn, profile_from_dict(raw, "calibration"))
        a_src = (
            f"{run.cal}: MLAttention.forward_naive at 128-1024 tokens, less its kv_b GEMM, "
            "against the GEMM fit"
        )
    else:  # a refit of a calibration from before this measurement existed
        a_eff, a_src = 1.0, "assumption: not measured in the calibration refitted"
    raw["device"]["prefill_attention_efficiency"] = _fig(a_eff, a_src)
    run.log(f"  the attention core at {a_eff:.2f} of the GEMM rate")
    return attn


def _overheads_stage(run: _Calibration, raw: dict) -> list:
    """Step, layer and sequence overheads: decode steps of a tiny DeepSeek less the cost
    model's compute."""
    from moeserve.planner.hardware import profile_from_dict

    run.log("engine overheads (tiny DeepSeek, 2 and 8 layers, batch 1, 4 and 16) ...")
    eng = run.measure("engine_steps", lambda: measure_engine(run.threads))
    profile = profile_from_dict(raw, "calibration")
    step, layer, seq, seq_layer = fit_overheads(eng, lambda r: _compute_only(profile, r))
    src = f"{run.cal}: decode steps of a tiny DeepSeek minus the cost model's compute, fitted"
    raw["software"]["step_overhead_us"] = _fig(step, src)
    raw["software"]["layer_overhead_us"] = _fig(layer, src)
    raw["software"]["seq_overhead_us"] = _fig(seq, src)
    raw["software"]["seq_layer_overhead_us"] = _fig(seq_layer, src)
    run.log(
        f"  step {step:.0f} us, layer {layer:.1f} us, sequence {seq:.1f} us, "
        f"sequence x layer {seq_layer:.2f} us"
    )
    return eng


def _engine_collectives_stage(run: _Calibration, raw: dict, link: _LinkFit) -> list:
    """The link latencies and oversubscription as the engine's collectives see them (under
    TP 2, EP 2 and EP 4), replacing the micro-benchmark's."""
    run.log("collectives inside the engine (tiny DeepSeek under TP 2, EP 2, EP 4) ...")
    lay_rows = run.measure("engine_layouts", measure_engine_layouts)
    a2a, ar, over = fit_engine_collectives(lay_rows, raw)
    src = (
        f"{run.cal}: decode steps of a tiny DeepSeek under TP 2, EP 2, EP 4 "
        "(collectives as the engine issues them), fitted"
    )
    for level in ("intra_node", "inter_node"):
        net = raw["network"][level]
        how = src if level == "intra_node" else "assumption: one host; as inside the node"
        net["latency_us"] = _fig(a2a, how)
        net["allreduce_latency_us"] = _fig(ar, how)
        net["per_peer_us"] = _fig(0.0, f"{run.cal}: inside latency_us (2 and 4 ranks only here)")
    raw["software"]["oversubscription_us"] = _fig(over, src)
    run.log(
        f"  all-to-all {a2a:.0f} us, all-reduce {ar:.0f} us, {over:.0f} us per rank beyond "
        f"the cores (the micro-benchmark alone: {link.lat:.0f} + {link.per_peer:.0f} us/peer, "
        f"all-reduce {link.ar_lat:.0f} us)"
    )
    return lay_rows
