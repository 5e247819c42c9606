"""Weight-only int8: int8 rows with one fp32 scale each (``quant/int8.py``), fp32 activations.

    few rows (<= int8.MAX_ROWS), CPU   the kernel of ops/cpu/int8.c (AVX2 or AVX-512):
                                       streams q once
    any rows, AVX-512 CPU              the same call, from 24 rows the packed panels of
                                       ops/cpu/moe_packed.h: each 64-row panel converted into
                                       an fp32 buffer once, outer-product tiles over it
                                       (1.2-1.9x the blocks below at 512 rows)
    more rows (prefill), AVX2 CPU      blocks of weight rows dequantized into one reused fp32
                                       buffer that stays in cache, each block an MKL GEMM
                                       (as fast as dequantizing all first, without the
                                       full-size buffer: benchmarks/int8_gemm.py)
    anywhere else (CUDA, no int8_kernels)   the reference, ops/cpu/int8.py: linear_int8_ref

Activations of another dtype (bf16) are computed in fp32 and cast back. The routed experts of
a layer run in one call of ``moeserve_int8_moe_small``.
"""

from __future__ import annotations

import torch

from moeserve.ops.cpu import int8 as int8_kernels
from moeserve.ops.cpu import int8_heads
from moeserve.ops.formats.base import (
    WeightFormat,
    dequantized_blocks,
    into_fp32_out,
    through_fp32_rows,
)
from moeserve.quant.int8 import Int8Tensor, Int8Weight, as_int8


class Int8Format(WeightFormat):
    activation_dtype = torch.float32
    bytes_per_weight = 1.0
    scale_bytes_per_row = 4.0
    absorbed_bytes = 1.0  # int8 codes and their scales (quant/head_codes.py)
    kn_layout_ok = False
    rounds_activations = False  # w8a8_int8: every GEMM rounds its input rows to int8

    def kernels_available(self) -> bool:
        return int8_kernels.available()

    def make_weight(self, p):
        return Int8Weight(tuple(p.shape), device=p.device, weight_format=self.name)

    def dense(self, w, dtype):
        return as_int8(w).dequantize(dtype)

    def take_rows(self, w, ids_H):
        q = as_int8(w)
        return Int8Tensor(q.q[ids_H].contiguous(), q.scale[ids_H].contiguous(), self.name)

    def absorbed(self, kv_b, dtype, H, N, V, C):
        w = as_int8(kv_b)
        held = int8_heads.absorbed(w.q.view(H, N + V, C), w.scale.view(H, N + V, 1), N, dtype)
        return held or super().absorbed(kv_b, dtype, H, N, V, C)

    def linear(self, x, w, bias=None):
        w = as_int8(w)
        if bias is None and not self.rounds_activations and int8_kernels.usable(x, w):  # decode
            return int8_kernels.gemm_nt(x, w)
        return through_fp32_rows(x, w.shape[0], lambda x2: self.matmul(x2, w, None), bias)

    def linear_into(self, x, w, out):
        w = as_int8(w)
        return into_fp32_out(
            x, out, lambda x_, o: self.matmul(x_, w, o), lambda x_: self.linear(x_, w)
        )

    def matmul(self, x: torch.Tensor, w: Int8Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """fp32 ``x [M, K]`` times int8 ``w [N, K]``; into ``out`` (unit-stride rows) if
        given."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        return _int8_matmul(x, w, out)

    def moe_experts(self, x_RD, experts, counts, w13_EFD, w2_EDF, weight_R):
        q13, q2 = as_int8(w13_EFD), as_int8(w2_EDF)
        if int8_kernels.moe_usable(x_RD, counts, q13, q2):
            return int8_kernels.moe_experts(x_RD, experts, counts, q13, q2, weight_R)
        return None

    def head_gemm(self, x_HMK, w_HNK, out_HMN):
        """MLA's absorbed products on :meth:`absorbed`'s int8 codes (``w_HNK`` a
        :class:`~moeserve.quant.head_codes.HeadCodes`; int4's too)."""
        ok = out_HMN.dtype == torch.float32 and out_HMN.stride(2) == 1
        if ok and int8_heads.usable(x_HMK, w_HNK):
            return int8_heads.head_gemm_nt(x_HMK, w_HNK, out_HMN)
        return out_HMN.copy_(int8_heads.head_gemm_ref(x_HMK, w_HNK))

    def bind_linear(self, w, fallback):
        return int8_kernels.bind_gemm(as_int8(w), fallback)

    def bind_moe(self, w13_EFD, w2_EDF):
        return int8_kernels.BoundMoE.bind(as_int8(w13_EFD), as_int8(w2_EDF))

    def bind_head_gemm(self, w_HNK):
        return int8_heads.bind_head_gemm(w_HNK)


def _int8_matmul(x: torch.Tensor, w: Int8Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The weight-only paths of :meth:`Int8Format.matmul` (``x`` with unit-stride rows)."""
    if int8_kernels.usable(x, w):
        return int8_kernels.gemm_nt(x, w, out=out)
    M, N = x.shape[0], w.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if x.device.type == "cpu" and M > 0 and int8_kernels.available() and w.q.stride(1) == 1:
        return dequantized_blocks(x, w, out, int8_kernels.dequantize_into)
    return out.copy_(int8_kernels.linear_int8_ref(x, w.q, w.scale))


FORMAT = Int8Format("int8")
