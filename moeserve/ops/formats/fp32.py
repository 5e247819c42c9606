"""fp32 weights: the few-row kernels of ``ops/cpu/fp32.c`` for decode (AVX2 or AVX-512),
MKL behind ``F.linear`` for the rest."""

from __future__ import annotations

from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.formats.base import WeightFormat


class Fp32Format(WeightFormat):
    def kernels_available(self) -> bool:
        return fp32_kernels.available()

    def linear(self, x, w, bias=None):
        if fp32_kernels.usable(x, w):
            y = fp32_kernels.gemm_nt(x, w)
            return y if bias is None else y.add_(bias)
        return super().linear(x, w, bias)

    def linear_into(self, x, w, out):
        if fp32_kernels.usable(x, w) and out.stride(-1) == 1:
            return fp32_kernels.gemm_nt(x, w, out=out)
        return super().linear_into(x, w, out)

    def moe_experts(self, x_RD, experts, counts, w13_EFD, w2_EDF, weight_R):
        if fp32_kernels.moe_usable(x_RD, counts, w13_EFD, w2_EDF):
            return fp32_kernels.moe_experts(x_RD, experts, counts, w13_EFD, w2_EDF, weight_R)
        return None

    def head_gemm(self, x_HMK, w_HNK, out_HMN):
        if fp32_kernels.head_gemm_nt(x_HMK, w_HNK, out_HMN) is not None:
            return out_HMN
        return super().head_gemm(x_HMK, w_HNK, out_HMN)

    def bind_linear(self, w, fallback):
        return fp32_kernels.bind_gemm(w, fallback)

    def bind_moe(self, w13_EFD, w2_EDF):
        return fp32_kernels.BoundMoE.bind(w13_EFD, w2_EDF)

    def bind_head_gemm(self, w_HNK):
        return fp32_kernels.bind_head_gemm(w_HNK)


FORMAT = Fp32Format("fp32")
