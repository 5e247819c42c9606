"""Facts about the machine this process runs on: CPU feature flags, the device and dtype to
compute in, and where built kernels and the demo model are cached. The ground floor: imports
nothing of moeserve, so every kernel module may ask it."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

# the CPUs a process could run on before it was pinned to its rank's (launch/numa.py), as
# comma-separated ids: for threads that must not share the rank's cores with its compute
UNPINNED_CPUS_ENV = "MOESERVE_UNPINNED_CPUS"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags in the text of /proc/cpuinfo: x86's ``flags`` line (``avx2``,
    ``amx_tile``, ...) or aarch64's ``Features`` line (``asimd``, ``asimddp``, ``sve``, ...)
    of the first CPU; empty when it has neither."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (Linux; see :func:`parse_cpu_flags`); empty
    when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpu_flags(f.read())
    except OSError:
        return frozenset()


@lru_cache(maxsize=1)
def sve_vector_bits() -> int | None:
    """The SVE vector length, in bits, Linux gives new processes on this CPU
    (``/proc/sys/abi/sve_default_vector_length`` holds bytes); None without SVE or when
    unknown."""
    try:
        with open("/proc/sys/abi/sve_default_vector_length") as f:
            return int(f.read().strip()) * 8
    except (OSError, ValueError):
        return None


def cpu_has_fast_bf16() -> bool:
    """AVX-512-BF16 or AMX-BF16: bf16 compute is then faster than fp32 on this CPU."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def resolve_device(device: str) -> torch.device:
    """``auto``: the GPU when torch sees one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def default_cache_dir() -> str:
    """``$MOESERVE_CACHE``, else ``~/.cache/moeserve``."""
    return os.environ.get("MOESERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "moeserve"
    )


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs and on CPUs with fast bf16, else fp32 (the fast path on AVX2)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; choose auto, {', '.join(sorted(set(_DTYPES)))}"
        ) from None
