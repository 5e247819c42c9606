"""w4a8_int8: int4's weights (``quant/int4.py``: 4-bit codes, a scale and a zero point per
group of columns), and every GEMM's input rows rounded to int8 per token as w8a8_int8 rounds
them (``s = max|row| / 127``; each group's sum exact in int32, times its scale).

On a CPU with AMX-INT8 the products of 4 rows or more run on the int8 tiles, the codes
unpacked to int8 per job of 32 weight rows (``ops/cpu/int4_amx.c``): int4's bytes with AMX's
products. Fewer rows (decode), and any rows on a CPU without AMX, run on int4's integer dots
(AVX-512 VNNI or AVX2) with the rows and the MoE hidden put on their int8 grids first: the
same integer sums (``ops/cpu/int4_amx.py`` says which runs where). Elsewhere (AVX-512F without
VNNI, below 256 rows) the rows are rounded to their int8 grids in torch
(``int8_amx.fake_quant``) and run through int4's weight-only paths, and the routed experts run
per expert, so the hidden is rounded too. The
group size and symmetry are int4's options; an AWQ or GPTQ checkpoint serves in this format as
it does in int4's. MLA's absorbed ``W_UK``/``W_UV`` are held in bf16 where the bf16 AMX
kernels take them, as w8a8_int8 holds them, elsewhere as int4 holds them.
"""

from __future__ import annotations

from moeserve.ops.cpu import int4_amx, int8_amx
from moeserve.ops.formats.int4 import Int4Format
from moeserve.ops.formats.w8a8_int8 import W8a8Int8Format, amx_bf16_absorbed
from moeserve.quant.int4 import as_int4


class W4a8Int8Format(Int4Format):
    rounds_activations = True
    absorbed_bytes = W8a8Int8Format.absorbed_bytes

    def absorbed(self, kv_b, dtype, H, N, V, C):
        held = amx_bf16_absorbed(self, kv_b, dtype, H, N, V, C)
        return held or super().absorbed(kv_b, dtype, H, N, V, C)

    def kernels_available(self) -> bool:
        return int4_amx.available() or int4_amx.dots_available()

    def matmul(self, x, w, out):
        if x.stride(-1) != 1:
            x = x.contiguous()
        if int4_amx.usable(x, w):
            return int4_amx.gemm_nt(x, w, out=out)
        return super().matmul(int8_amx.fake_quant(x), w, out)

    def experts_in_order(self, x_RD, experts, counts, q13, q2, weight_R):
        if int4_amx.moe_usable(x_RD, counts, q13, q2):
            return int4_amx.moe_experts(x_RD, experts, counts, q13, q2, weight_R)
        return None  # the per-expert loop, each linear rounding its rows

    def bind_linear(self, w, fallback):
        w = as_int4(w)
        return None if w.perm is not None else int4_amx.bind_gemm(w, fallback)

    def bind_moe(self, w13_EFD, w2_EDF):
        return int4_amx.BoundMoE.bind(as_int4(w13_EFD), as_int4(w2_EDF))


FORMAT = W4a8Int8Format("w4a8_int8")
