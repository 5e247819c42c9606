"""MLA's absorbed decode as ops: the per-head products and the prebound decode step.

Shape legend: H heads, M rows, N outputs, K inputs.
"""

from __future__ import annotations

import torch

from moeserve.ops import formats
from moeserve.ops.cpu.mla_decode import MLADecodeCalls, MLADecodeWeights
from moeserve.ops.linear import BoundLinear


def head_gemm(x_HMK: torch.Tensor, w_HNK: torch.Tensor, out_HMN: torch.Tensor) -> torch.Tensor:
    """``out[h] = x[h] @ w[h].T`` by the weight's format (the fp32 kernel, the AMX one for
    bf16 weights, or ``bmm``, the reference, in the weight's dtype)."""
    return formats.of(w_HNK).head_gemm(x_HMK, w_HNK, out_HMN)


def absorbed_weights(
    kv_b_weight, dtype: torch.dtype, H: int, N: int, V: int, C: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK [H, C, N], W_UV [H, V, C])`` from ``kv_b_proj``'s weight ``[H * (N + V), C]``,
    held as its format wants them for decode (dense in ``dtype``, or int8 codes with their
    scales: ``quant/head_codes.py``)."""
    return formats.of(kv_b_weight).absorbed(kv_b_weight, dtype, H, N, V, C)


def bind_mla_decode(
    qkv_a_weight,
    q_b_weight,
    o_weight,
    uk_HCN: torch.Tensor,
    uv_HVC: torch.Tensor,
    **fields,
) -> MLADecodeCalls | None:
    """The absorbed decode of one layer as prebound kernel calls (``ops/cpu/mla_decode.py``):
    its projections bound by their formats, the absorbed weights' per-head products bound by
    theirs; ``fields`` are the other :class:`MLADecodeWeights` fields. None where they do not
    apply."""
    w = MLADecodeWeights(
        qkv_a=BoundLinear(qkv_a_weight),
        q_b=BoundLinear(q_b_weight),
        o=BoundLinear(o_weight),
        uk=formats.of(uk_HCN).bind_head_gemm(uk_HCN),
        uv=formats.of(uv_HVC).bind_head_gemm(uv_HVC),
        **fields,
    )
    return MLADecodeCalls.bind(w)
