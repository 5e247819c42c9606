"""Grouped-query attention (Qwen-MoE) over a paged KV cache.

Shape legend: T tokens, H query heads, G kv heads, Hd head dim, L context length,
B decode sequences. Cache of one layer: ``[num_slots, 2, G, Hd]`` (k then v).

Tensor parallelism splits the query heads over ``tp`` and the KV heads with them when they
divide by ``tp``; with fewer KV heads than ranks, each rank keeps the one KV head its query
heads use (replicated over ``tp / G`` ranks). ``o_proj`` is split by input columns.
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.distributed.groups import Axis
from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.layers.linear import Linear, RowParallelLinear, copy_into, shard_range
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.hf_config import ModelConfig
from moeserve.models.weights import WeightSpec
from moeserve.ops.cpu import attention as cpu_attention
from moeserve.ops.prefill_attention import causal_attention_parts


class GQAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype=torch.float32,
        tp: Axis | None = None,
    ) -> None:
        super().__init__()
        c = config
        tp = tp or Axis.single("tp")
        H, G, self.Hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if H % tp.size or (G % tp.size and tp.size % G):
            raise ValueError(
                f"{H} query / {G} KV heads cannot be split over tensor-parallel size {tp.size}"
            )
        self.H = H // tp.size
        self.G = max(1, G // tp.size)
        # first KV head of this rank in the checkpoint's numbering
        self.kv_head0 = tp.rank * self.G if G >= tp.size else tp.rank // (tp.size // G)
        self.full_H, self.full_G, self.tp = H, G, tp
        D = c.hidden_size
        self.q_size, self.kv_size = self.H * self.Hd, self.G * self.Hd
        self.qkv_proj = Linear(
            D, self.q_size + 2 * self.kv_size, bias=c.attention_bias, dtype=dtype
        )
        self.o_proj = RowParallelLinear(H * self.Hd, D, tp, dtype=dtype)
        self.q_norm = RMSNorm(self.Hd, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(self.Hd, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.rotary = rotary  # shared by all layers
        self.scale = self.Hd**-0.5
        self.kv_cache: torch.Tensor | None = None  # [num_slots, 2, G, Hd]

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        d, Hd = w.shape[1], self.Hd
        q_rows = (self.tp.rank * self.q_size, self.q_size)
        kv_rows = (self.kv_head0 * Hd, self.kv_size)
        # name: (offset in the fused local weight, full rows in the checkpoint, rows to read)
        parts = {
            "q_proj": (0, self.full_H * Hd, q_rows),
            "k_proj": (self.q_size, self.full_G * Hd, kv_rows),
            "v_proj": (self.q_size + self.kv_size, self.full_G * Hd, kv_rows),
        }
        specs: dict[str, WeightSpec] = {}
        for name, (off, full, (start, n)) in parts.items():
            shard = shard_range(full, 0, start, n)
            specs[f"{prefix}.{name}.weight"] = WeightSpec(
                (full, d), copy_into(w[off : off + n]), shard
            )
            if b is not None:
                specs[f"{prefix}.{name}.bias"] = WeightSpec(
                    (full,), copy_into(b[off : off + n]), shard
                )
        specs.update(self.o_proj.weight_specs(f"{prefix}.o_proj"))
        for name in ("q_norm", "k_norm"):
            norm = getattr(self, name)
            if norm is not None:
                specs[f"{prefix}.{name}.weight"] = WeightSpec((self.Hd,), copy_into(norm.weight))
        return specs

    def forward(
        self, positions_T: torch.Tensor, x_TD: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        T = x_TD.shape[0]
        q, k, v = self.qkv_proj(x_TD).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_THD, k_TGD, v_TGD = (
            q.view(T, self.H, self.Hd),
            k.view(T, self.G, self.Hd),
            v.view(T, self.G, self.Hd),
        )
        if self.q_norm is not None:
            q_THD, k_TGD = self.q_norm(q_THD), self.k_norm(k_TGD)
        q_THD = self.rotary(positions_T, q_THD)
        k_TGD = self.rotary(positions_T, k_TGD)
        kv_T2GD = torch.stack((k_TGD, v_TGD), dim=1)
        if self.kv_cache is not None:
            self.kv_cache.index_copy_(0, meta.slot_mapping_T, kv_T2GD)

        out_THD = x_TD.new_empty(T, self.H, self.Hd)
        nd = meta.num_decodes
        if nd:
            self._attend_decode(q_THD[:nd], meta, out_THD[:nd])
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            ctx_L2GD = (
                kv_T2GD[rows]
                if chunk.slots_L is None
                else self.kv_cache.index_select(0, chunk.slots_L)
            )
            self._attend_prefill(q_THD[rows], ctx_L2GD, out_THD[rows])
        return self.o_proj(out_THD.view(T, self.q_size))

    def _attend_prefill(
        self, q_THD: torch.Tensor, ctx_L2GD: torch.Tensor, out_THD: torch.Tensor
    ) -> torch.Tensor:
        """One sequence's chunk (queries the last T of its L positions) into ``out_THD``."""
        k_LGD, v_LGD = ctx_L2GD[:, 0], ctx_L2GD[:, 1]
        return causal_attention_parts(q_THD, k_LGD, None, v_LGD, self.scale, out_THD)

    def _attend_decode(
        self, q_BHD: torch.Tensor, meta: AttentionMetadata, out_BHD: torch.Tensor
    ) -> None:
        """Writes the decodes' attention into ``out_BHD``: the paged kernel, or the gather
        reference where it does not apply."""
        args = (meta.decode_block_table_BN, meta.decode_context_lens_B, meta.block_size)
        if cpu_attention.gqa_decode(q_BHD, self.kv_cache, *args, self.scale, out_BHD) is None:
            out_BHD.copy_(
                cpu_attention.gqa_decode_ref(
                    q_BHD, self.kv_cache, meta.decode_slots_BL, meta.decode_bias_B1L, self.scale
                )
            )
