"""What machine a calibration ran on: the CPU model, its ISA extensions, its caches and the
kernel variant the engine picks, written into the profile's ``measured_on`` section (read
by people, not by the planner) so a profile says what it was measured on; and the machine
facts the profile's figures take as they are (NUMA domains, the kernels' row limits)."""

from __future__ import annotations

import os
from pathlib import Path

# the extensions that change which kernel runs (fp32 GEMMs: AVX2/AVX-512F; int8: VNNI;
# bf16: AVX512-BF16 / AMX)
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def cpuinfo(text: str | None = None) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def cache_sizes(cpu_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> dict[str, str]:
    """``{"L1d": "48K", "L2": "2048K", "L3": "307200K (shared by 0-1)"}`` from sysfs."""
    out: dict[str, str] = {}
    base = Path(cpu_dir)
    for idx in sorted(base.glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
            shared = (idx / "shared_cpu_list").read_text().strip()
        except OSError:
            continue
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        out[name] = f"{size} (shared by CPUs {shared})"
    return out


def last_level_cache_mb(caches: dict[str, str]) -> float:
    """The largest cache's size in MB (1e6 bytes); 0 when unknown."""
    best = 0.0
    for text in caches.values():
        size = text.split()[0]
        mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(size[-1:], 1)
        try:
            best = max(best, float(size.rstrip("KMG")) * mult / 1e6)
        except ValueError:
            continue
    return best


def describe_host(today: str, torch_version: str, kernel_variant: str) -> dict:
    """The ``measured_on`` section of a calibrated profile."""
    info = cpuinfo()
    flags = set(info.get("flags", "").split())
    caches = cache_sizes()
    return {
        "date": today,
        "cpu_model": info.get("model name", "unknown"),
        "cpu_id": (
            f"{info.get('vendor_id', '?')} family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')} stepping {info.get('stepping', '?')}"
        ),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "isa": [f for f in ISA_FLAGS if f in flags],
        "caches": caches,
        "engine_kernels": kernel_variant,
        "torch": str(torch_version),
    }


def numa_domains() -> int:
    """NUMA nodes Linux reports (1 where it reports none)."""
    try:
        nodes = [d for d in os.listdir("/sys/devices/system/node") if d[4:].isdigit()]
    except OSError:
        return 1
    return max(1, sum(1 for d in nodes if d.startswith("node")))


def kernel_variant() -> str:
    """Which fp32 kernels the engine runs here (the calibration times those)."""
    import torch

    from moeserve.ops.cpu import fp32 as fp32_kernels

    mkl = "MKL" if torch.backends.mkl.is_available() else "torch"
    if not fp32_kernels.available():
        return f"torch reference for few rows (no compiled fp32_kernels), {mkl} for many"
    isa = "AVX-512F" if fp32_kernels.wide() else "AVX2+FMA"
    return (
        f"ops/cpu/fp32.c {isa} for <= {fp32_kernels.MAX_ROWS} rows and the MoE, {mkl} for more rows"
    )


def kernel_max_rows() -> int:
    """Rows up to which ``linear`` runs the engine's own kernel (0: MKL for every count)."""
    from moeserve.ops.cpu import fp32 as fp32_kernels

    return fp32_kernels.MAX_ROWS if fp32_kernels.available() else 0


def expert_gemm_min_rows() -> int:
    """Rows from which the engine's MoE call runs an expert as MKL GEMMs here (0: never, or
    no fp32_kernels)."""
    from moeserve.ops.cpu import fp32 as fp32_kernels

    return (fp32_kernels.mkl_min_rows() or 0) if fp32_kernels.available() else 0
