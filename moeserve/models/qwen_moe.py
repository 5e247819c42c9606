"""Qwen3-MoE (GQA with q/k RMSNorm, softmax top-k) and Qwen2-MoE (qkv bias, gated shared
expert); one class, the differences come from :class:`ModelConfig`."""

from __future__ import annotations

import torch
from torch import nn

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
    ) -> None:
        super().__init__(config, dtype, max_positions or config.max_position_embeddings)

    def make_rotary(self, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(self.config.rope, self.config.head_dim, max_positions)

    def make_attention(self, rotary: RotaryEmbedding) -> nn.Module:
        return GQAttention(self.config, rotary, self.dtype)

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.config
        return KVCacheSpec(c.num_hidden_layers, (2, c.num_key_value_heads, c.head_dim), self.dtype)
