"""fp32 weights: the few-row kernels of ``ops/cpu/kernels.c`` for decode (AVX2 or AVX-512),
MKL behind ``F.linear`` for the rest."""

from __future__ import annotations

from moeserve.ops.cpu import kernels
from moeserve.ops.formats.base import WeightFormat


class Fp32Format(WeightFormat):
    def kernels_available(self) -> bool:
        return kernels.available()

    def linear(self, x, w, bias=None):
        if kernels.usable(x, w):
            y = kernels.gemm_nt(x, w)
            return y if bias is None else y.add_(bias)
        return super().linear(x, w, bias)

    def linear_into(self, x, w, out):
        if kernels.usable(x, w) and out.stride(-1) == 1:
            return kernels.gemm_nt(x, w, out=out)
        return super().linear_into(x, w, out)

    def moe_experts(self, x_RD, experts, counts, w13_EFD, w2_EDF, weight_R):
        if kernels.moe_usable(x_RD, counts, w13_EFD, w2_EDF):
            return kernels.moe_experts(x_RD, experts, counts, w13_EFD, w2_EDF, weight_R)
        return None

    def head_gemm(self, x_HMK, w_HNK, out_HMN):
        if kernels.head_gemm_nt(x_HMK, w_HNK, out_HMN) is not None:
            return out_HMN
        return super().head_gemm(x_HMK, w_HNK, out_HMN)

    def bind_linear(self, w, fallback):
        return kernels.bind_gemm(w, fallback)

    def bind_moe(self, w13_EFD, w2_EDF):
        return kernels.BoundMoE.bind(w13_EFD, w2_EDF)

    def bind_head_gemm(self, w_HNK):
        return kernels.bind_head_gemm(w_HNK)


FORMAT = Fp32Format("fp32")
