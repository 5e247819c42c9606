"""The decoder-only MoE skeleton shared by DeepSeek-V3 and Qwen-MoE.

A model sees token ids, positions and the step's :class:`AttentionMetadata`; it never sees
requests. It declares its checkpoint tensors through ``weight_specs()`` and its per-token KV
footprint through ``kv_cache_spec()``; the runner binds one cache tensor per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.layers.linear import GatedMLP, Linear, copy_into
from moeserve.layers.moe import MoEBlock
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.hf_config import ModelConfig
from moeserve.models.weights import WeightSpec
from moeserve.ops.cpu import kernels
from moeserve.ops.linear import linear


@dataclass(frozen=True)
class KVCacheSpec:
    """Each layer caches ``token_shape`` numbers of ``dtype`` per token."""

    num_layers: int
    token_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        n = 1
        for s in self.token_shape:
            n *= s
        return n * self.num_layers * torch.empty(0, dtype=self.dtype).element_size()


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, attn: nn.Module, dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(layer_idx):
            self.mlp: nn.Module = MoEBlock(config, dtype)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype)

    def forward(
        self, positions_T: torch.Tensor, h_TD: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        h_TD = h_TD + self.self_attn(positions_T, self.input_layernorm(h_TD), meta)
        return h_TD + self.mlp(self.post_attention_layernorm(h_TD))

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        specs = {
            f"{prefix}.{n}.weight": WeightSpec(tuple(m.weight.shape), copy_into(m.weight))
            for n, m in (
                ("input_layernorm", self.input_layernorm),
                ("post_attention_layernorm", self.post_attention_layernorm),
            )
        }
        specs.update(self.self_attn.weight_specs(f"{prefix}.self_attn"))
        specs.update(self.mlp.weight_specs(f"{prefix}.mlp"))
        return specs


class MoECausalLM(nn.Module):
    """embed -> decoder layers -> final norm; ``compute_logits`` applies the LM head."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        D, V = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Parameter(torch.empty(V, D, dtype=dtype), requires_grad=False)
        self.rotary = self.make_rotary(max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.make_attention(self.rotary), dtype)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(D, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else Linear(D, V, dtype=dtype)

    def make_rotary(self, max_positions: int) -> RotaryEmbedding:
        raise NotImplementedError

    def make_attention(self, rotary: RotaryEmbedding) -> nn.Module:
        raise NotImplementedError

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError

    def bind_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """Give each layer its cache tensor ``[num_slots, *token_shape]``."""
        if len(caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} layer caches, got {len(caches)}")
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.kv_cache = cache

    def forward(
        self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, D]``."""
        h_TD = self.embed_tokens[input_ids_T]
        for layer in self.layers:
            h_TD = layer(positions_T, h_TD, meta)
        return self.norm(h_TD)

    def compute_logits(self, h_ND: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens if self.lm_head is None else self.lm_head.weight
        return linear(h_ND, w).float()

    def weight_specs(self) -> dict[str, WeightSpec]:
        specs = {
            "model.embed_tokens.weight": WeightSpec(
                tuple(self.embed_tokens.shape), copy_into(self.embed_tokens)
            ),
            "model.norm.weight": WeightSpec(
                tuple(self.norm.weight.shape), copy_into(self.norm.weight)
            ),
        }
        if self.lm_head is not None:
            specs.update(self.lm_head.weight_specs("lm_head"))
        for i, layer in enumerate(self.layers):
            specs.update(layer.weight_specs(f"model.layers.{i}"))
        return specs

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        if prefers_kn_layout(self.embed_tokens.device, self.dtype):
            relayout_kn(self)

    @staticmethod
    def ignored_checkpoint_tensor(name: str) -> bool:
        """Tensors some checkpoints carry that no model needs."""
        return name.endswith("rotary_emb.inv_freq")


def prefers_kn_layout(device: torch.device, dtype: torch.dtype) -> bool:
    """Without the few-row kernel (``ops/cpu``), MKL's fp32 GEMMs with few rows (decode) stream
    a ``[K, N]`` weight ~1.2-2x faster than an ``[N, K]`` one on AVX2 CPUs (measured:
    docs/benchmarks.md); the kernel and bf16 want ``[N, K]``."""
    return device.type == "cpu" and dtype == torch.float32 and not kernels.available()


@torch.no_grad()
def relayout_kn(model: nn.Module) -> None:
    """Store every projection weight as ``[K, N]`` memory behind an ``[N, K]`` view.

    Code keeps calling ``F.linear(x, w)`` on the same ``[N, K]`` shape; only the strides change,
    so the GEMM reads the weight row-major over N. Embedding tables (row lookups) and router
    gates stay as they are. One parameter is copied at a time.
    """
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name or name.endswith("gate.weight"):
            continue
        p.data = p.data.transpose(-1, -2).contiguous().transpose(-1, -2)
