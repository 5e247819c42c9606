"""Routed-expert MoE: the router (gate) and the experts this rank holds.

Shape legend: T tokens, D model dim, F expert FFN dim, E experts (local), K top-k.

The experts are computed by ``ops/moe.py`` (the T*K (token, expert) pairs sorted by expert,
the weight format's one-call kernel or one pair of GEMMs per expert that received tokens;
``moe_reference`` there is the per-token loop used as the oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.distributed.ep.placement import EMPTY_SLOT
from moeserve.distributed.groups import Axis
from moeserve.layers.linear import shard_range
from moeserve.models.hf_config import ModelConfig
from moeserve.models.weights import WeightSpec
from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.linear import linear
from moeserve.ops.moe import experts_sorted
from moeserve.ops.routing import route_grouped_sigmoid, route_softmax


class Router(nn.Module):
    """The gate: ``[E, D]`` logits in fp32 plus the model's routing rule."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        E, D = config.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(E, D, dtype=torch.float32), requires_grad=False)
        self.sigmoid = config.scoring_func == "sigmoid"
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
            if self.sigmoid
            else None
        )

    def forward(
        self,
        x_TD: torch.Tensor,
        counts_E: torch.Tensor | None = None,
        extra_id: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_w_TK, topk_ids_TK)``. ``counts_E`` gains one per routed choice; with
        ``extra_id`` every token also gets that slot at weight 1 (the last column)."""
        c = self.config
        if self.sigmoid:
            logits_TE = linear(x_TD.float(), self.weight)
            args = (
                logits_TE,
                self.e_score_correction_bias,
                c.num_experts_per_tok,
                c.n_group,
                c.topk_group,
                c.norm_topk_prob,
                c.routed_scaling_factor,
            )
            fast = fp32_kernels.route_grouped_sigmoid(*args, counts_E=counts_E, extra_id=extra_id)
            if fast is not None:  # counted and extended in C
                return fast
            topk_w_TK, topk_ids_TK = route_grouped_sigmoid(*args)
        else:
            # Qwen computes its router logits in the model dtype
            logits_TE = F.linear(x_TD, self.weight.to(x_TD.dtype))
            topk_w_TK, topk_ids_TK = route_softmax(
                logits_TE, c.num_experts_per_tok, c.norm_topk_prob
            )
        if counts_E is not None:
            counts_E += torch.bincount(topk_ids_TK.flatten(), minlength=counts_E.shape[0])
        if extra_id is not None:
            T = topk_ids_TK.shape[0]
            topk_ids_TK = torch.cat((topk_ids_TK, topk_ids_TK.new_full((T, 1), extra_id)), 1)
            topk_w_TK = torch.cat((topk_w_TK, topk_w_TK.new_ones(T, 1)), 1)
        return topk_w_TK, topk_ids_TK

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        from moeserve.layers.linear import copy_into

        specs = {f"{prefix}.weight": WeightSpec(tuple(self.weight.shape), copy_into(self.weight))}
        if self.e_score_correction_bias is not None:
            b = self.e_score_correction_bias
            specs[f"{prefix}.e_score_correction_bias"] = WeightSpec(tuple(b.shape), copy_into(b))
        return specs


class FusedExperts(nn.Module):
    """The routed experts this rank holds, stacked by local slot: ``w13_EFD [S, 2F, D]`` (gate
    rows then up rows), ``w2_EDF [S, D, F]``.

    ``slot_experts[s]`` is the logical (checkpoint) expert in local slot s: all experts in
    order on one process, this rank's share under expert parallelism (a logical expert may
    fill several slots; ``EMPTY_SLOT`` in a replacement's slots until it joins). Under
    tensor parallelism without EP, each slot holds F / tp of its expert's FFN (``tp``): gate
    and up rows ``[r * F/tp, (r + 1) * F/tp)``, the same down columns, and the layer's output
    is a partial sum.
    """

    def __init__(
        self,
        slot_experts: list[int],
        hidden: int,
        ffn: int,
        dtype=torch.float32,
        tp: Axis | None = None,
        extra_slots: int = 0,
    ) -> None:
        super().__init__()
        self.tp = tp or Axis.single("tp")
        if ffn % self.tp.size:
            raise ValueError(f"expert FFN size {ffn} does not divide by tp={self.tp.size}")
        self.slot_experts = list(slot_experts)
        self.full_ffn, self.ffn = ffn, ffn // self.tp.size
        # slots after the routed ones hold other FFNs of the same shape (a shared expert run
        # in the same call as the routed ones): loaded through slot_specs
        S = len(self.slot_experts) + extra_slots
        self.w13_EFD = nn.Parameter(
            torch.empty(S, 2 * self.ffn, hidden, dtype=dtype), requires_grad=False
        )
        self.w2_EDF = nn.Parameter(
            torch.empty(S, hidden, self.ffn, dtype=dtype), requires_grad=False
        )

    @property
    def local_experts(self) -> frozenset[int]:
        return frozenset(self.slot_experts)

    def compute_sorted(
        self, x_RD: torch.Tensor, weight_R: torch.Tensor, slot_counts: list[int] | tuple[int, ...]
    ) -> torch.Tensor:
        """A dispatcher's rows (sorted by local slot, ``slot_counts[s]`` rows for slot ``s``)
        through their slots' FFNs, each times its ``weight_R`` (``ops/moe.experts_sorted``)."""
        return experts_sorted(x_RD, weight_R, slot_counts, self.w13_EFD, self.w2_EDF)

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        slots: dict[int, list[int]] = {}
        for s, e in enumerate(self.slot_experts):
            if e != EMPTY_SLOT:  # filled later, over the network (elastic EP)
                slots.setdefault(e, []).append(s)
        specs: dict[str, WeightSpec] = {}
        for e, ss in slots.items():
            specs.update(self.slot_specs(f"{prefix}.{e}", ss))
        return specs

    def slot_specs(self, prefix: str, slots: list[int]) -> dict[str, WeightSpec]:
        """Specs that load one gated FFN's ``gate_proj``/``up_proj``/``down_proj`` (this
        rank's F / tp share) into every slot in ``slots``."""
        f, d, r = self.ffn, self.w13_EFD.shape[2], self.tp.rank
        full = (self.full_ffn, d)
        return {
            f"{prefix}.gate_proj.weight": _slots_spec(
                full, self.w13_EFD, slots, slice(0, f), 0, r, f
            ),
            f"{prefix}.up_proj.weight": _slots_spec(
                full, self.w13_EFD, slots, slice(f, 2 * f), 0, r, f
            ),
            f"{prefix}.down_proj.weight": _slots_spec(
                (d, self.full_ffn), self.w2_EDF, slots, slice(None), 1, r, f
            ),
        }


def _slots_spec(
    full: tuple[int, int],
    w: torch.Tensor,
    slots: list[int],
    rows: slice,
    dim: int,
    index: int,
    length: int,
) -> WeightSpec:
    """Read ``length`` entries of ``dim`` (shard ``index``) into ``w[s, rows]`` of every slot
    in ``slots``."""

    def load(t: torch.Tensor) -> None:
        for s in slots:
            w[s, rows].copy_(t)

    shard = shard_range(full[dim], dim, index * length, length)
    return WeightSpec(full, load, shard)
