"""Causal attention of a prefill chunk through the AVX-512F kernel of ``prefill_attention.c``.

Shape legend: T queries (the last T of the L context positions), H query heads, G kv heads
(H a multiple of G), D1 and D2 the two parts of a key, V value head dim.

:func:`causal_attention` returns None where the kernel does not apply (no AVX-512F, kernels
off, not fp32 on the CPU, an inner dim with a stride); the caller then runs the blocked
torch form of ``ops/prefill_attention.py``, whose reference is SDPA with the causal mask.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from moeserve.ops.cpu import build
from moeserve.ops.cpu.build import F32, I64, INT, PTR
from moeserve.ops.cpu.fp32 import wide

_SOURCE = Path(__file__).with_name("prefill_attention.c")


@lru_cache(maxsize=1)
def _library():
    lib = build.load(_SOURCE)
    if lib is None:
        return None
    build.declare(
        lib,
        "moeserve_prefill_attention",
        *(I64, I64, I64, I64),
        *(PTR, I64, I64),
        *(PTR, I64, I64, I64) * 2,
        *(PTR, I64, I64, I64),
        F32,
        *(PTR, I64, I64),
    )
    lib.moeserve_prefill_attention.restype = INT
    return lib


def available() -> bool:
    """Whether the kernel runs here: AVX-512F (``MOESERVE_CPU_AVX512=0`` turns it off) and a
    built library."""
    return wide() and _library() is not None


def causal_attention(
    q_THK: torch.Tensor,
    k1_LGD: torch.Tensor,
    k2_LGD: torch.Tensor | None,
    v_LGV: torch.Tensor,
    scale: float,
    out_THV: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``[T, H, V]``: each query head h attends, causally, over the keys ``[k1 | k2]`` and values
    of kv head ``h // (H // G)``; ``q_THK`` holds the D1 + D2 matching values. ``k2_LGD`` may
    be None (plain keys) or have head stride 0 (MLA's k_pe, shared by all heads). Written into
    ``out_THV`` when given. None when the kernel does not apply."""
    T, H, Dq = q_THK.shape
    L, G, D1 = k1_LGD.shape
    D2 = 0 if k2_LGD is None else k2_LGD.shape[2]
    Dv = v_LGV.shape[2]
    if out_THV is None:
        out_THV = q_THK.new_empty(T, H, Dv)
    parts = [q_THK, k1_LGD, v_LGV, out_THV] + ([] if k2_LGD is None else [k2_LGD])
    if not (
        0 < T <= L
        and G > 0
        and H % G == 0
        and Dq == D1 + D2
        and v_LGV.shape[:2] == (L, G)
        and out_THV.shape == (T, H, Dv)
        and (k2_LGD is None or k2_LGD.shape[:2] == (L, G))
        and all(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in parts
        )
        and available()
    ):
        return None
    k2_ptr, k2_strides = (0, (0, 0)) if k2_LGD is None else (k2_LGD.data_ptr(), k2_LGD.stride()[:2])
    rc = _library().moeserve_prefill_attention(
        H,
        T,
        L,
        H // G,
        q_THK.data_ptr(),
        *q_THK.stride()[:2],
        k1_LGD.data_ptr(),
        *k1_LGD.stride()[:2],
        D1,
        k2_ptr,
        *k2_strides,
        D2,
        v_LGV.data_ptr(),
        *v_LGV.stride()[:2],
        Dv,
        scale,
        out_THV.data_ptr(),
        *out_THV.stride()[:2],
    )
    if rc != 0:
        raise MemoryError(f"prefill attention over {L} positions: no memory for its buffers")
    return out_THV
