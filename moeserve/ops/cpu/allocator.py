"""Keep freed memory for reuse: glibc's malloc settings for an inference process.

A step allocates large temporaries (the rows sorted by expert, the expert FFN's hidden
rows, attention scores, logits) and frees them before the next step. By default glibc serves
blocks above a dynamic threshold (at most 32 MB) with fresh ``mmap`` pages and returns freed
heap tops to the OS, so every step pays the page faults again: a fresh large buffer is written
several times slower than a reused one here. Raising the mmap threshold to 1 GiB and never
trimming keeps those pages in the process: prefill of 2048 tokens on the benchmark model went
from ~420 to ~485 tokens/s (docs/benchmarks.md). The cost is that the resident size stays at
its high-water mark, as with the tcmalloc/jemalloc set-ups the PyTorch CPU guides recommend.

Those settings are per process, so a second engine loaded in the same process (a benchmark
going through layouts, a test suite) would keep its load-time copies of the weights in the
heap after moving them to huge pages; :func:`release_freed_memory` hands free heap pages back
once loading is done.

``MOESERVE_MALLOC_TUNING=0`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from functools import cache

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30
_TRIM_THRESHOLD = (1 << 31) - 1


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Return the heap's free pages to the OS now (glibc ``malloc_trim(0)``, which also
    releases free pages inside the heap); True when it released any. Loading calls it: with
    :func:`keep_freed_memory` already applied in this process, the freed load-time copies of
    the weights (several GB) would otherwise stay resident."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False  # not glibc
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim(0) == 1


@cache
def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when they took effect (glibc only)."""
    if os.environ.get("MOESERVE_MALLOC_TUNING", "1") == "0":
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False  # not glibc (musl, macOS): nothing to tune
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    logger.debug("malloc tuning (mmap threshold 1 GiB, no trimming): %s", ok)
    return ok
