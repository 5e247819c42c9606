"""Rotary position embedding: default, linear and YaRN scaling; half-split or interleaved pairs.

The cos/sin table is built once for ``max_positions`` with the same fp32 arithmetic as the
Hugging Face reference (``position * inv_freq``), so looked-up values match it bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeserve.models.hf_config import RopeConfig
from moeserve.ops.cpu.rope import apply_rope


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(rope: RopeConfig, head_dim: int) -> float:
    """Attention softmax scale: head_dim**-0.5, times mscale(all_dim)**2 under YaRN (DeepSeek)."""
    scale = head_dim**-0.5
    if rope.type != "default" and rope.mscale_all_dim:
        m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


def inv_freq_and_attention_factor(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.type == "linear":
        return 1.0 / pos_freqs / rope.factor, 1.0
    # YaRN (https://arxiv.org/abs/2309.00071), as transformers and DeepSeek compute it
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = yarn_get_mscale(factor)
    orig = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the last dim of ``x`` at ``positions_T``.

    ``interleave=True`` rotates pairs (x0, x1), (x2, x3), ... and returns them de-interleaved
    ([rotated evens | rotated odds]), exactly as transformers' DeepSeek code does; because q
    and k get the same permutation, their dot products are unchanged.

    One instance serves every layer of a model: the cos/sin rows of the step's positions are
    looked up once and reused while the same ``positions_T`` tensor comes back (it must not be
    modified in place during a forward).
    """

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int) -> None:
        super().__init__()
        self.dim = dim
        self.interleave = rope.interleave
        inv_freq, attention_factor = inv_freq_and_attention_factor(rope, dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_cached", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cached", freqs.sin() * attention_factor, persistent=False)
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, positions_T: torch.Tensor, dtype: torch.dtype):
        last = self._last
        if last is None or last[0] is not positions_T or last[1] != dtype:
            cos = self.cos_cached[positions_T].to(dtype)
            sin = self.sin_cached[positions_T].to(dtype)
            last = self._last = (positions_T, dtype, cos, sin)
        return last[2], last[3]

    def forward(self, positions_T: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., dim] -> same shape, rotated."""
        cos, sin = self._cos_sin(positions_T, x.dtype)
        return apply_rope(x, cos, sin, self.interleave)
