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
  experts     ``ops.moe.moe_grouped`` at 1..512 tokens, 64 experts top-6 plus a shared
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
from pathlib import Path

from moeserve.planner.calibrate.profile import build_profile

__all__ = ["build_profile", "read_measurements", "write_profile"]


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
