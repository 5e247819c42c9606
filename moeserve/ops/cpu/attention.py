"""Decode attention over the paged KV cache without gathering the context (``attention.c``),
with the pure-torch references: gather the context slots, two bmms and a masked softmax.

Shape legend: B decode sequences, H query heads, G kv heads, Hd head dim, C kv_lora_rank,
R qk_rope_head_dim, L context length, N blocks per table row, S cache slots.

A decode's context is its first ``context_lens_B[b]`` tokens; token ``p`` lives in slot
``block_table_BN[b, p // block_size] * block_size + p % block_size``. The kernel functions
return None when they do not apply (no kernel here, queries not fp32 on the CPU, a cache
neither fp32 nor bf16); the caller then runs
the reference over ``slots_BL`` and ``bias_B1L`` (``AttentionMetadata`` builds both).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from moeserve.ops.cpu import build
from moeserve.ops.cpu.build import F32, I64, INT, PTR
from moeserve.ops.cpu.fp32 import wide

_SOURCE = Path(__file__).with_name("attention.c")
MAX_HEADS_PER_KV = 256  # HMAX in attention.c


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = build.load(_SOURCE)
    if lib is None:
        return None
    build.declare(
        lib,
        "moeserve_paged_decode_attention",
        *(I64,) * 6,
        *(PTR, I64, I64) * 2,
        F32,
        PTR,
        *(I64,) * 5,
        PTR,
        I64,
        PTR,
        I64,
        PTR,
        I64,
        I64,
        INT,
        INT,
    )
    lib.moeserve_paged_decode_attention.restype = INT
    return lib


def available() -> bool:
    return _library() is not None


def _usable(*queries: torch.Tensor, cache: torch.Tensor) -> bool:
    """fp32 CPU queries over an fp32 or bf16 cache (its rows are widened as they are read)"""
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in queries)
        and cache.dtype in (torch.float32, torch.bfloat16)
        and cache.device.type == "cpu"
        and available()
    )


def _paged_decode(
    q1: torch.Tensor,
    q2: torch.Tensor | None,
    cache: torch.Tensor,
    ld_slot: int,
    key: tuple[int, int, int],
    value: tuple[int, int, int],
    block_table_BN: torch.Tensor,
    context_lens_B: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """``key``/``value``: (offset in a slot's row, stride between kv heads, dims)."""
    B, H, D1 = q1.shape
    G = cache.shape[2] if cache.dim() == 4 else 1
    q1 = q1 if q1.stride(-1) == 1 else q1.contiguous()
    q2 = q1 if q2 is None else q2 if q2.stride(-1) == 1 else q2.contiguous()
    table = block_table_BN.to(torch.int32).contiguous()
    lens = context_lens_B.to(torch.int32).contiguous()
    rc = _call(
        (B, G, H // G, key[2], value[2], D1, q1, q1.stride(0), q1.stride(1), q2, q2.stride(0),
         q2.stride(1), scale, cache, ld_slot, key[0], key[1], value[0], value[1], table,
         table.stride(0), lens, block_size, out, out.stride(0), out.stride(1),
         int(cache.dtype == torch.bfloat16), int(wide()))
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("decode attention: out of memory for its scratch buffers")
    return out


def _call(args: tuple) -> int:
    """``moeserve_paged_decode_attention`` on ``args`` in its order, each tensor passed as its
    data pointer (``tests/unit/ops/cpu/test_arm_attention.py`` runs them on the aarch64
    build under emulation instead)."""
    ptrs = (a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    return _library().moeserve_paged_decode_attention(*ptrs)


def mla_decode(
    q_lat_BHC: torch.Tensor,
    q_pe_BHR: torch.Tensor,
    kv_cache_SK: torch.Tensor,
    block_table_BN: torch.Tensor,
    context_lens_B: torch.Tensor,
    block_size: int,
    scale: float,
    out_BHC: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Absorbed MLA decode: ``softmax(scale * [q_lat | q_pe] . ctx) @ c_kv`` per head, over a
    latent cache ``[S, C + R]`` (per token ``[c_kv | k_pe]``); None when the kernel does not
    apply. ``out_BHC`` (any batch/head strides, unit last stride) receives the result."""
    B, H, C = q_lat_BHC.shape
    R = q_pe_BHR.shape[-1]
    if not (
        _usable(q_lat_BHC, q_pe_BHR, cache=kv_cache_SK)
        and kv_cache_SK.dim() == 2
        and kv_cache_SK.shape[1] == C + R
        and kv_cache_SK.stride(1) == 1
        and H <= MAX_HEADS_PER_KV
        and (out_BHC is None or out_BHC.stride(-1) == 1)
    ):
        return None
    if out_BHC is None:
        out_BHC = torch.empty(B, H, C)
    return _paged_decode(
        q_lat_BHC,
        q_pe_BHR,
        kv_cache_SK,
        kv_cache_SK.stride(0),
        (0, 0, C + R),
        (0, 0, C),
        block_table_BN,
        context_lens_B,
        block_size,
        scale,
        out_BHC,
    )


def gqa_decode(
    q_BHD: torch.Tensor,
    kv_cache_S2GD: torch.Tensor,
    block_table_BN: torch.Tensor,
    context_lens_B: torch.Tensor,
    block_size: int,
    scale: float,
    out_BHD: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Grouped-query decode over a cache ``[S, 2, G, Hd]`` (k then v); query head ``h`` reads
    kv head ``h // (H // G)``. None when the kernel does not apply."""
    B, H, Hd = q_BHD.shape
    G = kv_cache_S2GD.shape[2]
    if not (
        _usable(q_BHD, cache=kv_cache_S2GD)
        and kv_cache_S2GD.is_contiguous()
        and H % G == 0
        and H // G <= MAX_HEADS_PER_KV
        and (out_BHD is None or out_BHD.stride(-1) == 1)
    ):
        return None
    if out_BHD is None:
        out_BHD = torch.empty(B, H, Hd)
    return _paged_decode(
        q_BHD,
        None,
        kv_cache_S2GD,
        2 * G * Hd,
        (0, Hd, Hd),
        (G * Hd, Hd, Hd),
        block_table_BN,
        context_lens_B,
        block_size,
        scale,
        out_BHD,
    )


def mla_decode_ref(
    q_lat_BHC: torch.Tensor,
    q_pe_BHR: torch.Tensor,
    kv_cache_SK: torch.Tensor,
    slots_BL: torch.Tensor,
    bias_B1L: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The reference of :func:`mla_decode`: gather the context, then bmm, softmax, bmm."""
    C = q_lat_BHC.shape[-1]
    ctx_BLK = kv_cache_SK[slots_BL]  # [B, L, C + R]
    q_BHK = torch.cat((q_lat_BHC, q_pe_BHR), dim=-1)
    scores_BHL = torch.bmm(q_BHK, ctx_BLK.transpose(1, 2)).mul_(scale)
    scores_BHL.add_(bias_B1L.to(scores_BHL.dtype))
    probs_BHL = torch.softmax(scores_BHL, dim=-1, dtype=torch.float32).to(q_BHK.dtype)
    return torch.bmm(probs_BHL, ctx_BLK[:, :, :C])


def gqa_decode_ref(
    q_BHD: torch.Tensor,
    kv_cache_S2GD: torch.Tensor,
    slots_BL: torch.Tensor,
    bias_B1L: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The reference of :func:`gqa_decode`."""
    B, H, Hd = q_BHD.shape
    G, L = kv_cache_S2GD.shape[2], slots_BL.shape[1]
    ctx_BL2GD = kv_cache_S2GD[slots_BL]
    # group query heads by their kv head: [B, G, rep, Hd] x [B, G, Hd, L]
    q_BGrD = q_BHD.view(B, G, H // G, Hd)
    k_BGDL = ctx_BL2GD[:, :, 0].permute(0, 2, 3, 1)
    v_BGLD = ctx_BL2GD[:, :, 1].permute(0, 2, 1, 3)
    scores = torch.matmul(q_BGrD, k_BGDL).mul_(scale)  # [B, G, rep, L]
    scores.add_(bias_B1L.view(B, 1, 1, L).to(scores.dtype))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_BHD.dtype)
    return torch.matmul(probs, v_BGLD).reshape(B, H, Hd)
