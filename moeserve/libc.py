"""The two calls into the C library that Python's standard library lacks, for process
hygiene (not kernels: those live in ``ops/cpu``). Each does nothing where it is unavailable.
On the ground floor; imports neither torch nor anything of moeserve, so a small helper
process (the chat-template sandbox) starts fast."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
from functools import lru_cache

_PR_SET_PDEATHSIG = 1


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux
    ``PR_SET_PDEATHSIG``). Returns whether it could."""
    libc = _libc()
    if libc is None or not hasattr(libc, "prctl"):
        return False
    return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def release_free_heap() -> None:
    """Return the free pages of the C heap to the system (glibc's ``malloc_trim``): after a
    large, short-lived allocation (a long prompt tokenized), the resident size drops back
    instead of staying at its peak."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
