"""Grouped-query attention (Qwen-MoE) over a paged KV cache.

Shape legend: T tokens, H query heads, G kv heads, Hd head dim, L context length,
B decode sequences. Cache of one layer: ``[num_slots, 2, G, Hd]`` (k then v).

Tensor parallelism splits the query heads over ``tp`` and the KV heads with them when they
divide by ``tp``; with fewer KV heads than ranks, each rank keeps the one KV head its query
heads use (replicated over ``tp / G`` ranks). ``o_proj`` is split by input columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.distributed.groups import Axis
from moeserve.layers.attention_meta import AttentionMetadata, causal_bias
from moeserve.layers.linear import Linear, RowParallelLinear, copy_into, shard_range
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.hf_config import ModelConfig
from moeserve.models.weights import WeightSpec


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
            ctx_BL2GD = self.kv_cache[meta.decode_slots_BL]
            out_THD[:nd] = self._attend_decode(q_THD[:nd], ctx_BL2GD, meta.decode_bias_B1L)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            ctx_L2GD = (
                kv_T2GD[rows]
                if chunk.slots_L is None
                else self.kv_cache.index_select(0, chunk.slots_L)
            )
            out_THD[rows] = self._attend_prefill(q_THD[rows], ctx_L2GD)
        return self.o_proj(out_THD.view(T, self.q_size))

    def _attend_prefill(self, q_THD: torch.Tensor, ctx_L2GD: torch.Tensor) -> torch.Tensor:
        T, L = q_THD.shape[0], ctx_L2GD.shape[0]
        rep = self.H // self.G
        k_HLD = ctx_L2GD[:, 0].repeat_interleave(rep, dim=1).transpose(0, 1)
        v_HLD = ctx_L2GD[:, 1].repeat_interleave(rep, dim=1).transpose(0, 1)
        mask = causal_bias(T, L, q_THD.dtype, q_THD.device)
        out_HTD = F.scaled_dot_product_attention(
            q_THD.transpose(0, 1), k_HLD, v_HLD, attn_mask=mask, scale=self.scale
        )
        return out_HTD.transpose(0, 1)

    def _attend_decode(
        self, q_BHD: torch.Tensor, ctx_BL2GD: torch.Tensor, bias_B1L: torch.Tensor
    ) -> torch.Tensor:
        B, L = ctx_BL2GD.shape[:2]
        rep = self.H // self.G
        # group query heads by their kv head: [B, G, rep, Hd] x [B, G, Hd, L]
        q_BGrD = q_BHD.view(B, self.G, rep, self.Hd)
        k_BGDL = ctx_BL2GD[:, :, 0].permute(0, 2, 3, 1)
        v_BGLD = ctx_BL2GD[:, :, 1].permute(0, 2, 1, 3)
        scores = torch.matmul(q_BGrD, k_BGDL).mul_(self.scale)  # [B, G, rep, L]
        scores.add_(bias_B1L.view(B, 1, 1, L).to(scores.dtype))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_BHD.dtype)
        return torch.matmul(probs, v_BGLD).reshape(B, self.H, self.Hd)
