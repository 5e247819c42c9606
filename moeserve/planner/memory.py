"""What one rank must hold: its weights, its KV cache and a step's activations, in bytes.

The busiest stage counts (the first holds the embedding and the dense layers, the last the
LM head and the MTP modules; with one stage, all of it). A layout fits when
``weights + kv + activations <= device memory / ranks per device * (1 - reserve)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.planner.cost_model import Rank
from moeserve.planner.model_spec import ModelSpec


@dataclass(frozen=True)
class MemoryUse:
    weights: float
    kv_cache: float
    activations: float
    capacity: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict[str, float]:
        return {
            "weights_bytes": self.weights,
            "kv_cache_bytes": self.kv_cache,
            "activation_bytes": self.activations,
            "total_bytes": self.total,
            "capacity_bytes": self.capacity,
        }


def layer_weight_elems(rank: Rank, spec: ModelSpec, moe: bool) -> float:
    """Weight elements of one decoder layer on one rank."""
    lay, D, H = rank.layout, spec.hidden, spec.num_heads
    tp = lay.tp
    if spec.is_mla:
        kv_a = D * (spec.kv_lora_rank + spec.qk_rope_dim)  # replicated over TP
        if spec.q_lora_rank:
            q = D * spec.q_lora_rank + spec.q_lora_rank * H * spec.qk_head_dim / tp
        else:
            q = D * H * spec.qk_head_dim / tp
        kv_b = spec.kv_lora_rank * H * (spec.qk_nope_dim + spec.v_head_dim) / tp
        attn = q + kv_a + kv_b + H * spec.v_head_dim * D / tp
    else:
        kv_t = max(1, spec.num_kv_heads // tp)
        attn = D * (H / tp + 2 * kv_t) * spec.head_dim + H / tp * spec.head_dim * D
    if not moe:
        return attn + 3 * D * spec.dense_intermediate / tp
    e = spec.expert_params()
    if lay.expert_parallel:
        experts = (spec.num_experts + lay.redundant_experts) / lay.ep * e
        shared = 3 * D * spec.shared_intermediate
    else:
        experts = spec.num_experts * e / tp
        shared = 3 * D * spec.shared_intermediate / tp
    return attn + experts + shared + D * spec.num_experts


def stage_weight_bytes(rank: Rank, spec: ModelSpec) -> float:
    """Weights of the heaviest pipeline stage on one rank."""
    lay, D = rank.layout, spec.hidden
    per = -(-spec.num_layers // lay.pp)
    dense_w = layer_weight_elems(rank, spec, False)
    moe_w = layer_weight_elems(rank, spec, True)
    vocab = spec.vocab * D / lay.tp
    worst = 0.0
    for s in range(lay.pp):
        lo, hi = s * per, min(spec.num_layers, (s + 1) * per)
        dense = max(0, min(hi, spec.num_dense_layers) - lo)
        elems = dense * dense_w + (hi - lo - dense) * moe_w
        if s == 0:
            elems += vocab
        if s == lay.pp - 1:
            elems += 0 if (spec.tie_embeddings and lay.pp == 1) else vocab
            if lay.mtp_depth:  # every MTP module: projection 2D -> D and one MoE layer
                elems += spec.num_mtp_layers * (2 * D * D + moe_w)
        worst = max(worst, elems)
    return worst * rank.wbytes


def kv_cache_bytes(rank: Rank, spec: ModelSpec, seqs: float, ctx_len: float) -> float:
    """``seqs`` sequences of ``ctx_len`` tokens held by one rank for its stage's layers."""
    lay = rank.layout
    layers = -(-spec.num_layers // lay.pp) + (spec.num_mtp_layers if lay.mtp_depth else 0)
    return seqs * ctx_len * spec.kv_elems_per_token_layer(lay.tp) * layers * rank.kvbytes


def activation_bytes(rank: Rank, spec: ModelSpec, tokens: float, logits_rows: float) -> float:
    """Live tensors of the largest op of a step of ``tokens`` tokens (the residual stream,
    the widest intermediate, the routed rows and the logits)."""
    lay, D = rank.layout, spec.hidden
    H_t = spec.num_heads / lay.tp
    qkv = H_t * (spec.qk_head_dim + (spec.v_head_dim if spec.is_mla else spec.head_dim)) * 2
    wide = max(2 * spec.dense_intermediate / lay.tp, qkv, 2 * spec.shared_intermediate)
    routed = tokens * spec.top_k * (D + 2 * spec.moe_intermediate) / max(1, lay.tp)
    logits = logits_rows * spec.vocab * 4
    return (tokens * (3 * D + wide) + routed) * rank.abytes + logits


def rank_memory(
    rank: Rank, spec: ModelSpec, seqs: float, ctx_len: float, step_tokens: float, logits_rows
) -> MemoryUse:
    return MemoryUse(
        weights=stage_weight_bytes(rank, spec),
        kv_cache=kv_cache_bytes(rank, spec, seqs, ctx_len),
        activations=activation_bytes(rank, spec, step_tokens, logits_rows),
        capacity=rank.memory_bytes,
    )
