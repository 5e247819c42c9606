"""w8a8_int8 (SGLang's name): int8's weights, and every GEMM's input rows rounded to int8 per
token as well (``s = max|row| / 127``, ``y = (xq . q) * scale * s`` with exact int32 sums).

On a CPU with AMX-INT8 the products run on the int8 tiles (``ops/cpu/int8_amx.c``, any row
count); elsewhere the rows are rounded to their int8 grids (``int8_amx.fake_quant``) and run
through the weight-only int8 paths, and the routed experts run per expert, so the hidden is
rounded too. MLA's absorbed ``W_UK``/``W_UV`` are held in bf16 where the bf16 AMX kernels take
them (3.3x the fp32 head products at 32 rows; this format's prefill rounds those inputs to
int8 anyway), elsewhere as int8 holds them.
"""

from __future__ import annotations

from moeserve.ops.cpu import bf16_amx, int8_amx
from moeserve.ops.formats.base import dense_absorbed
from moeserve.ops.formats.int8 import Int8Format, _int8_matmul
from moeserve.quant.int8 import as_int8


class W8a8Int8Format(Int8Format):
    rounds_activations = True
    absorbed_bytes = 2.0  # bf16 where the AMX kernels take them (int8's 1 elsewhere)

    def kernels_available(self) -> bool:
        return int8_amx.available()

    def matmul(self, x, w, out):
        if x.stride(-1) != 1:
            x = x.contiguous()
        if int8_amx.usable(x, w):
            return int8_amx.gemm_nt(x, w, out=out)
        return _int8_matmul(int8_amx.fake_quant(x), w, out)

    def moe_experts(self, x_RD, experts, counts, w13_EFD, w2_EDF, weight_R):
        q13, q2 = as_int8(w13_EFD), as_int8(w2_EDF)
        if int8_amx.moe_usable(x_RD, counts, q13, q2):
            return int8_amx.moe_experts(x_RD, experts, counts, q13, q2, weight_R)
        return None  # the per-expert loop, each linear rounding its rows

    def absorbed(self, kv_b, dtype, H, N, V, C):
        held = amx_bf16_absorbed(self, kv_b, dtype, H, N, V, C)
        return held or super().absorbed(kv_b, dtype, H, N, V, C)

    def bind_linear(self, w, fallback):
        return int8_amx.bind_gemm(as_int8(w), fallback)

    def bind_moe(self, w13_EFD, w2_EDF):
        return int8_amx.BoundMoE.bind(as_int8(w13_EFD), as_int8(w2_EDF))


def amx_bf16_absorbed(fmt, kv_b, dtype, H, N, V, C) -> tuple | None:
    """MLA's absorbed weights from ``fmt``'s ``kv_b`` in bf16 where the bf16 AMX kernels take
    them (w8a8_int8's and w4a8_int8's choice there), else None."""
    if kv_b.device.type != "cpu" or not bf16_amx.available():
        return None
    uk, uv = (t.bfloat16() for t in dense_absorbed(fmt.dense(kv_b, dtype), H, N, V, C))
    return (uk, uv) if bf16_amx.weight_ok(uk) and bf16_amx.weight_ok(uv) else None


FORMAT = W8a8Int8Format("w8a8_int8")
