"""Qwen3-MoE (GQA with q/k RMSNorm, softmax top-k) and Qwen2-MoE (qkv bias, gated shared
expert); one class, the differences come from :class:`ModelConfig`."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.config import MoEOptions
from moeserve.distributed.groups import Axis, ParallelGroups
from moeserve.layers.attention import GQAttention
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.base import KVCacheSpec, MoECausalLM
from moeserve.models.hf_config import ModelConfig


class QwenMoeForCausalLM(MoECausalLM):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        load_mtp: bool = True,
        groups: ParallelGroups | None = None,
        moe_options: MoEOptions | None = None,
    ) -> None:
        super().__init__(
            config, dtype, max_positions or config.max_position_embeddings, groups, moe_options
        )

    def make_rotary(self, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(self.config.rope, self.config.head_dim, max_positions)

    def make_attention(self, rotary: RotaryEmbedding, tp: Axis) -> nn.Module:
        return GQAttention(self.config, rotary, self.dtype, tp)

    def kv_cache_spec(self) -> KVCacheSpec:
        c, tp = self.config, self.tp.size
        kv_heads = max(1, c.num_key_value_heads // tp)  # this rank's KV heads
        return KVCacheSpec(len(self.layers), (2, kv_heads, c.head_dim), self.dtype)
