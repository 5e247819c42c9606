"""The fused MLA rotary + latent-cache write of ``rope.c`` and its pure-torch reference.

Shape legend: T tokens, H heads, N qk_nope_head_dim, R qk_rope_head_dim, C kv_lora_rank,
Q q_lora_rank, S cache slots, P table positions.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from moeserve.ops.cpu import build
from moeserve.ops.cpu.build import F32, I64, INT, PTR

_SOURCE = Path(__file__).with_name("rope.c")
MAX_HALF = 512  # in rope.c


def apply_rope(
    x: torch.Tensor, cos_TX: torch.Tensor, sin_TX: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """RoPE of the last dim of ``x [T, ..., R]`` with the cos/sin rows ``[T, R/2]`` of its
    positions; interleaved pairs come out de-interleaved (the C kernel of
    ``ops/cpu/rope.c`` does the same arithmetic)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos_TX.shape[-1],)
    cos, sin = cos_TX.view(shape), sin_TX.view(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = build.load(_SOURCE)
    if lib is None:
        return None
    build.declare(
        lib,
        "moeserve_mla_rope_cache",
        *(I64,) * 5,
        PTR,
        I64,
        PTR,
        I64,
        PTR,
        F32,
        PTR,
        PTR,
        PTR,
        INT,
        PTR,
        PTR,
    )
    return lib


def mla_rope_cache_ref(
    q_THK: torch.Tensor,
    kv_TL: torch.Tensor,
    norm_w_C: torch.Tensor,
    eps: float,
    cos_PX: torch.Tensor,
    sin_PX: torch.Tensor,
    positions_T: torch.Tensor,
    interleave: bool,
    cache_SL: torch.Tensor,
    slots_T: torch.Tensor,
) -> None:
    """Reference of :func:`mla_rope_cache`: rope the last R dims of every head of ``q_THK``
    in place; write ``[rmsnorm(kv[:, :C]) | rope(kv[:, C:])]`` into the cache rows
    ``slots_T``."""
    C = norm_w_C.shape[0]
    R = kv_TL.shape[-1] - C
    cos, sin = cos_PX[positions_T], sin_PX[positions_T]
    q_pe = q_THK[..., -R:]
    q_pe.copy_(apply_rope(q_pe, cos, sin, interleave))
    c_kv = F.rms_norm(kv_TL[:, :C], (C,), norm_w_C, eps)
    k_pe = apply_rope(kv_TL[:, C:], cos, sin, interleave)
    cache_SL.index_copy_(0, slots_T, torch.cat((c_kv, k_pe), dim=-1))


def mla_rope_cache(
    q_THK: torch.Tensor,
    kv_TL: torch.Tensor,
    norm_w_C: torch.Tensor,
    eps: float,
    cos_PX: torch.Tensor,
    sin_PX: torch.Tensor,
    positions_T: torch.Tensor,
    interleave: bool,
    cache_SL: torch.Tensor,
    slots_T: torch.Tensor,
) -> bool:
    """The kernel: ``q_THK [T, H, N + R]`` (rows of unit-stride heads, any row stride) roped
    in place; ``kv_TL [T, C + R]`` (unit-stride rows) normed and roped into the cache rows
    ``slots_T`` of ``cache_SL [S, C + R]``. Returns False, having done nothing, where it does
    not apply (the caller then runs :func:`mla_rope_cache_ref`)."""
    lib = _library()
    T, H, K = q_THK.shape
    C = norm_w_C.shape[0]
    R = kv_TL.shape[1] - C
    tensors = (q_THK, kv_TL, norm_w_C, cos_PX, sin_PX, cache_SL)
    if not (
        lib is not None
        and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
        and q_THK.stride(2) == 1
        and q_THK.stride(1) == K
        and kv_TL.stride(1) == 1
        and norm_w_C.is_contiguous()
        and cos_PX.is_contiguous()
        and sin_PX.is_contiguous()
        and cos_PX.shape[1] * 2 == R
        and R <= 2 * MAX_HALF
        and cache_SL.is_contiguous()
        and cache_SL.shape[1] == C + R
        and positions_T.dtype == slots_T.dtype == torch.int64
        and positions_T.is_contiguous()
        and slots_T.is_contiguous()
    ):
        return False
    lib.moeserve_mla_rope_cache(
        T,
        H,
        K - R,
        R,
        C,
        q_THK.data_ptr(),
        q_THK.stride(0),
        kv_TL.data_ptr(),
        kv_TL.stride(0),
        norm_w_C.data_ptr(),
        eps,
        cos_PX.data_ptr(),
        sin_PX.data_ptr(),
        positions_T.data_ptr(),
        int(interleave),
        cache_SL.data_ptr(),
        slots_T.data_ptr(),
    )
    return True
