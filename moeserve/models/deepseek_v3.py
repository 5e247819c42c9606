"""DeepSeek-V3: MLA attention, dense first layers, group-limited sigmoid-routed MoE, MTP layers.

MTP layers (``model.layers.{N..N+k-1}`` with ``N = num_hidden_layers``) are loaded into
``mtp_layers`` for speculative decoding; ``load_mtp=False`` skips them to save memory. Where
this rank holds the whole vocabulary (no tensor parallelism), an MTP layer uses the main
model's embedding and LM head, as DeepSeek-V3 shares them (and transformers' ``MtpModel``
does): the checkpoint's copies, if any, are skipped unread, and a checkpoint without them
loads.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from moeserve.config import MoEOptions
from moeserve.distributed.groups import Axis, ParallelGroups
from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.layers.linear import Linear, copy_into
from moeserve.layers.mla import MLAttention
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.base import DecoderLayer, KVCacheSpec, MoECausalLM
from moeserve.models.hf_config import ModelConfig
from moeserve.models.weights import WeightSpec

logger = logging.getLogger(__name__)


class MTPLayer(nn.Module):
    """One next-token-prediction module: combines the main model's hidden state at position i
    with the embedding of token i+1 and runs one more decoder layer to predict token i+2."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        dtype,
        shared: tuple[nn.Parameter, nn.Module] | None = None,
    ) -> None:
        """``shared``: the main model's (embedding weight, LM head), used instead of own
        copies."""
        super().__init__()
        D, V = config.hidden_size, config.vocab_size
        self.shares_main = shared is not None
        if shared is None:
            self.embed_tokens = nn.Parameter(torch.empty(V, D, dtype=dtype), requires_grad=False)
            self.head: nn.Module = Linear(D, V, dtype=dtype)
        else:
            self.embed_tokens, self.head = shared
        self.enorm = RMSNorm(D, config.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(D, config.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * D, D, dtype=dtype)
        self.block = DecoderLayer(config, layer_idx, MLAttention(config, rotary, dtype), dtype)
        self.head_norm = RMSNorm(D, config.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids_T: torch.Tensor,
        positions_T: torch.Tensor,
        h_prev_TD: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        e_TD = self.enorm(self.embed_tokens[input_ids_T])
        h_TD = self.eh_proj(torch.cat((e_TD, self.hnorm(h_prev_TD)), dim=-1))
        return self.head_norm(self.block(positions_T, h_TD, meta))

    def compute_logits(self, h_ND: torch.Tensor) -> torch.Tensor:
        return self.head(h_ND).float()

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        specs = self.block.weight_specs(prefix)
        own = [("enorm.weight", self.enorm.weight), ("hnorm.weight", self.hnorm.weight)]
        own.append(("shared_head.norm.weight", self.head_norm.weight))
        if not self.shares_main:
            own.append(("embed_tokens.weight", self.embed_tokens))
            specs.update(self.head.weight_specs(f"{prefix}.shared_head.head"))
        for name, p in own:
            specs[f"{prefix}.{name}"] = WeightSpec(tuple(p.shape), copy_into(p))
        specs.update(self.eh_proj.weight_specs(f"{prefix}.eh_proj"))
        return specs


class DeepseekV3ForCausalLM(MoECausalLM):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        load_mtp: bool = True,
        groups: ParallelGroups | None = None,
        moe_options: MoEOptions | None = None,
    ) -> None:
        max_positions = max_positions or config.max_position_embeddings
        super().__init__(config, dtype, max_positions, groups, moe_options)
        if self.groups.dims.world_size > 1 and load_mtp and not self.groups.is_replica_leader:
            # the MTP layer is not sharded: the replica leader (last stage, TP rank 0) holds it
            # whole and drafts for its replica; the other ranks skip its tensors
            load_mtp = False
        n_mtp = config.num_nextn_predict_layers if load_mtp else 0
        shared = None
        if self.tp.size == 1 and self.embed_tokens is not None and self.lm_head is not None:
            shared = (self.embed_tokens.weight, self.lm_head)
        self.mtp_layers = nn.ModuleList(
            MTPLayer(config, config.num_hidden_layers + i, self.rotary, dtype, shared)
            for i in range(n_mtp)
        )

    def make_rotary(self, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(self.config.rope, self.config.qk_rope_head_dim, max_positions)

    def make_attention(self, rotary: RotaryEmbedding, tp: Axis) -> nn.Module:
        return MLAttention(self.config, rotary, self.dtype, tp)

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.config
        return KVCacheSpec(len(self.layers), (c.kv_lora_rank + c.qk_rope_head_dim,), self.dtype)

    def weight_specs(self) -> dict[str, WeightSpec]:
        specs = super().weight_specs()
        for i, mtp in enumerate(self.mtp_layers):
            specs.update(mtp.weight_specs(f"model.layers.{self.config.num_hidden_layers + i}"))
        return specs

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        if super().ignored_checkpoint_tensor(name):
            return True
        # MTP tensors of a checkpoint whose MTP layers we chose not to load
        c = self.config
        if not name.startswith("model.layers."):
            return False
        idx = int(name.split(".")[2])
        if idx >= c.num_hidden_layers + len(self.mtp_layers):
            return True
        if idx < c.num_hidden_layers:
            return False
        shared = (".embed_tokens.weight", ".shared_head.head.weight")
        return self.mtp_layers[idx - c.num_hidden_layers].shares_main and name.endswith(shared)
