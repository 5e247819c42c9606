"""Group-wise int4 weights (``quant/int4.py``: 4-bit codes, an fp32 scale and an integer zero
point per ``group_size`` columns), fp32 activations.

    few rows (decode), CPU        the kernels of ops/cpu/int4.c (AVX2 or AVX-512): the
                                  nibbles unpacked in registers, each weight row streamed once
    12 rows or more, AMX-INT8     AMX's int8 tiles (ops/cpu/int4_amx.c with rows16): the codes
                                  unpacked to int8, each row in 16-bit fixed point on two byte
                                  planes, the rounding int4's integer dots use (4-5x the
                                  kernels above from 16 rows: docs/benchmarks.md)
    more rows (prefill), CPU      int4.c's kernels with AVX-512; with AVX2 blocks of weight
                                  rows dequantized into one reused fp32 buffer that stays in
                                  cache, each block an MKL GEMM
    anywhere else                 the reference, ops/cpu/int4.py: linear_int4_ref

The routed experts of a layer run in one call of ``moeserve_int4_moe_small`` (on AMX's tiles
from 6 rows an expert on average). Where weights
stream per decode step, int4 reads ``1/2 + 5/group_size`` bytes per weight (the codes, then
an fp32 scale and a one-byte zero point per group): 0.54 at group 128, a little over half of
int8's. The group size and symmetry are chosen at load (``EngineConfig.int4_group_size``,
``int4_symmetric``: :meth:`Int4Format.configured`); a weight carries its own, so computing
needs neither.
"""

from __future__ import annotations

from functools import cache

import torch

from moeserve.ops import formats
from moeserve.ops.cpu import int4 as int4_kernels
from moeserve.ops.cpu import int4_amx, int8_heads
from moeserve.ops.formats import check_options
from moeserve.ops.formats.base import (
    WeightFormat,
    dequantized_blocks,
    into_fp32_out,
    through_fp32_rows,
)
from moeserve.platform import cpu_flags
from moeserve.quant.int4 import DEFAULT_GROUP_SIZE, Int4Tensor, Int4Weight, as_int4


class Int4Format(WeightFormat):
    activation_dtype = torch.float32
    kn_layout_ok = False
    rounds_activations = False  # w4a8_int8: every GEMM rounds its input rows to int8
    absorbed_bytes = 1.0  # MLA's absorbed weights as int8 codes (quant/head_codes.py)

    def __init__(
        self,
        name: str,
        group_size: int = DEFAULT_GROUP_SIZE,
        symmetric: bool = True,
        act_order: bool = False,
    ) -> None:
        super().__init__(name)
        check_options(name, group_size, symmetric)
        self.group_size, self.symmetric, self.act_order = group_size, symmetric, act_order
        self.bytes_per_weight = 0.5 + 5.0 / group_size  # codes, fp32 scale, uint8 zero

    def __repr__(self) -> str:
        kind = ("" if self.symmetric else ", asymmetric") + (
            ", act-order" if self.act_order else ""
        )
        return f"<weight format {self.name} (group {self.group_size}{kind})>"

    def configured(
        self, group_size: int | None, symmetric: bool, act_order: bool = False
    ) -> Int4Format:
        """This format quantizing with ``group_size`` (None: the default) and ``symmetric``;
        ``act_order``: its weights hold a column order (a GPTQ act-order checkpoint)."""
        return _configured(
            type(self), self.name, group_size or DEFAULT_GROUP_SIZE, symmetric, act_order
        )

    def kernels_available(self) -> bool:
        return int4_kernels.available()

    def check_device(self, device):
        """A CPU without AVX2 and FMA has no int4 kernel: its torch reference dequantizes every
        weight per call, far slower than the formats it would replace, so it is refused."""
        if device.type == "cpu" and not {"avx2", "fma"} <= cpu_flags():
            raise ValueError(
                f"--quantization {self.name} needs a CPU with AVX2 and FMA (int4's kernels); "
                "this CPU lacks them: use int8 or bf16"
            )

    def make_weight(self, p):
        shape = tuple(p.shape)
        try:
            return Int4Weight(
                shape,
                self.group_size,
                self.symmetric,
                device=p.device,
                weight_format=self.name,
                act_order=self.act_order,
            )
        except ValueError as e:
            raise ValueError(f"--quantization {self.name}: {e}") from None

    def dense(self, w, dtype):
        return as_int4(w).dequantize(dtype)

    def take_rows(self, w, ids_H):
        return as_int4(w).take(ids_H)

    def absorbed(self, kv_b, dtype, H, N, V, C):
        """As int8 codes, exactly (``quant/head_codes.py``): the codes less their zero points,
        a scale per group; dense where a GPTQ act-order checkpoint reordered the columns."""
        w = as_int4(kv_b)
        held = None
        if w.perm is None:
            R = N + V
            codes, scale = w.signed_codes().view(H, R, C), w.scale.view(H, R, -1)
            held = int8_heads.absorbed(codes, scale, N, dtype)
        return held or super().absorbed(kv_b, dtype, H, N, V, C)

    def linear(self, x, w, bias=None):
        w = as_int4(w)
        if w.perm is not None:  # GPTQ act-order: the stored columns read x in their order
            x, w = x.index_select(-1, w.perm), _in_order(w)
        if bias is None and not self.rounds_activations:  # decode, or prefill on the tiles
            y = self._kernel(x, w, None)
            if y is not None:
                return y
        return through_fp32_rows(x, w.shape[0], lambda x2: self.matmul(x2, w, None), bias)

    def _kernel(self, x: torch.Tensor, w: Int4Tensor, out: torch.Tensor | None):
        """``x @ w.T`` by int4's kernels where one takes these rows (AMX's tiles from
        ``int4_amx.ROWS16_MIN`` rows, int4.c's below and where the tiles do not run), else
        None."""
        if int4_amx.rows16_usable(x, w):
            return int4_amx.gemm_nt(x, w, out=out, rows16=True)
        if int4_kernels.usable(x, w):
            return int4_kernels.gemm_nt(x, w, out=out)
        return None

    def linear_into(self, x, w, out):
        w = as_int4(w)
        if w.perm is not None:
            x, w = x.index_select(-1, w.perm), _in_order(w)
        return into_fp32_out(
            x, out, lambda x_, o: self.matmul(x_, w, o), lambda x_: self.linear(x_, w)
        )

    def matmul(self, x: torch.Tensor, w: Int4Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """fp32 ``x [M, K]`` times int4 ``w [N, K]``; into ``out`` (unit-stride rows) if
        given."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = self._kernel(x, w, out)
        if y is not None:
            return y
        M, N = x.shape[0], w.shape[0]
        if out is None:
            out = torch.empty(M, N, dtype=torch.float32, device=x.device)
        if x.device.type == "cpu" and M > 0 and int4_kernels.available() and w.q.stride(1) == 1:
            return dequantized_blocks(x, w, out, int4_kernels.dequantize_into)
        return out.copy_(int4_kernels.linear_int4_ref(x, w))

    def moe_experts(self, x_RD, experts, counts, w13_EFD, w2_EDF, weight_R):
        q13, q2 = as_int4(w13_EFD), as_int4(w2_EDF)
        if q2.perm is not None:  # folded into w13's rows at load (settle_int4): never here
            return None
        if q13.perm is not None:  # each row reads x in its expert's column order
            expert_R = torch.repeat_interleave(
                torch.tensor(experts, device=x_RD.device), torch.tensor(counts, device=x_RD.device)
            )
            x_RD = torch.gather(x_RD, 1, q13.perm[expert_R].long())
            q13 = _in_order(q13)
        return self.experts_in_order(x_RD, experts, counts, q13, q2, weight_R)

    def experts_in_order(self, x_RD, experts, counts, q13, q2, weight_R):
        """:meth:`moe_experts` once each row holds its columns in its weights' order: AMX's
        tiles from ``int4_amx.MOE_ROWS16_MIN`` rows an expert on average, else int4.c's
        call."""
        if int4_amx.moe_rows16_usable(x_RD, counts, q13, q2):
            return int4_amx.moe_experts(x_RD, experts, counts, q13, q2, weight_R, rows16=True)
        if int4_kernels.moe_usable(x_RD, counts, q13, q2):
            return int4_kernels.moe_experts(x_RD, experts, counts, q13, q2, weight_R)
        return None

    def bind_linear(self, w, fallback):
        w = as_int4(w)
        if w.perm is not None:
            return None
        # the rows the tiles take go to fallback (this format's linear), which sends them there
        most = int4_amx.ROWS16_MIN - 1 if int4_amx.tiles_take(w) else int4_kernels.MAX_ROWS
        return int4_kernels.bind_gemm(w, fallback, most)

    def bind_moe(self, w13_EFD, w2_EDF):
        q13, q2 = as_int4(w13_EFD), as_int4(w2_EDF)
        if q13.perm is not None or q2.perm is not None:
            return None  # moe_experts gathers the rows' columns first
        return int4_kernels.BoundMoE.bind(q13, q2)


def _in_order(w: Int4Tensor) -> Int4Tensor:
    """``w`` without its column order (the caller gathered x's columns already)."""
    return Int4Tensor(w.q, w.scale, w.zero, w.symmetric, w.weight_format)


@cache
def _configured(
    cls: type[Int4Format], name: str, group_size: int, symmetric: bool, act_order: bool
) -> Int4Format:
    if group_size == DEFAULT_GROUP_SIZE and symmetric and not act_order:
        return formats.get(name)  # the registered instance
    return cls(name, group_size, symmetric, act_order)


FORMAT = Int4Format("int4")
