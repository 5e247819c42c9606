"""bf16 weights on AMX (``ops/cpu/bf16_amx.c``): the tiles take the weight straight from its
``[N, K]`` rows and fp32 or bf16 activations (fp32 rows are rounded to bf16 as they are
packed), for decode and prefill alike. Where AMX does not run (x86 without it, aarch64), the
few-row fp32 kernels' bodies take the bf16 weights as they are, widened in registers, with
fp32 rows (``ops/cpu/fp32.c``: the GEMM, the one-call MoE, the per-head GEMM; exact in the
weights, as widening them in torch is); on an aarch64 CPU with the BF16 extension they round
the rows to bf16 once per call, as AMX does, and run on BFMMLA/BFDOT (``bf16_mmla.h``).
Elsewhere (more rows without AMX, other dtypes) the weight is widened per call.

Under ``--quantization bf16`` (and ``dtype="auto"`` on a CPU with AMX) the weights of every
projection and expert are held in bf16, rounded to nearest as they load (lossless from a
bf16 checkpoint), and the activations stay fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.ops.cpu import bf16_amx
from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.formats.base import WeightFormat


class Bf16Format(WeightFormat):
    activation_dtype = torch.float32
    bytes_per_weight = 2.0
    absorbed_bytes = 2.0

    def kernels_available(self) -> bool:
        return bf16_amx.available()  # the AMX kernels (the row kernels are fp32's)

    def make_weight(self, p):
        w = torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)
        return nn.Parameter(w, requires_grad=False)

    def linear(self, x, w, bias=None):
        if bf16_amx.usable(x, w):
            y = bf16_amx.gemm_nt(x, w)
            return y if bias is None else y.add_(bias)
        if fp32_kernels.usable(x, w):  # few fp32 rows without AMX
            y = fp32_kernels.gemm_nt(x, w)
            return y if bias is None else y.add_(bias)
        return super().linear(x, w, bias)

    def linear_into(self, x, w, out):
        if (
            bf16_amx.usable(x, w)
            and out.stride(-1) == 1
            and out.dtype in (torch.bfloat16, torch.float32)
        ):
            return bf16_amx.gemm_nt(x, w, out=out)
        if fp32_kernels.usable(x, w) and out.stride(-1) == 1 and out.dtype == torch.float32:
            return fp32_kernels.gemm_nt(x, w, out=out)
        return super().linear_into(x, w, out)

    def moe_experts(self, x_RD, experts, counts, w13_EFD, w2_EDF, weight_R):
        if bf16_amx.moe_usable(x_RD, counts, w13_EFD, w2_EDF):
            return bf16_amx.moe_experts(x_RD, experts, counts, w13_EFD, w2_EDF, weight_R)
        if fp32_kernels.moe_usable(x_RD, counts, w13_EFD, w2_EDF):
            return fp32_kernels.moe_experts(x_RD, experts, counts, w13_EFD, w2_EDF, weight_R)
        return None

    def head_gemm(self, x_HMK, w_HNK, out_HMN):
        if bf16_amx.head_usable(x_HMK, w_HNK):
            return bf16_amx.head_gemm_nt(x_HMK, w_HNK, out_HMN)
        if fp32_kernels.head_gemm_nt(x_HMK, w_HNK, out_HMN) is not None:
            return out_HMN
        return super().head_gemm(x_HMK, w_HNK, out_HMN)

    def bind_linear(self, w, fallback):
        return bf16_amx.bind_gemm(w, fallback) or fp32_kernels.bind_gemm(w, fallback)

    def bind_moe(self, w13_EFD, w2_EDF):
        bound = bf16_amx.BoundMoE.bind(w13_EFD, w2_EDF)
        return bound or fp32_kernels.BoundMoE.bind(w13_EFD, w2_EDF)

    def bind_head_gemm(self, w_HNK):
        return bf16_amx.bind_head_gemm(w_HNK) or fp32_kernels.bind_head_gemm(w_HNK)


FORMAT = Bf16Format("bf16")
