"""Routed-expert MoE: the router (gate) and the grouped expert computation.

Shape legend: T tokens, D model dim, F expert FFN dim, E experts (local), K top-k.

The fast path sorts the T*K (token, expert) pairs by expert and runs one pair of GEMMs per
expert that received tokens; :func:`moe_reference` is the per-token loop used as the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.distributed.groups import Axis
from moeserve.layers.linear import shard_range
from moeserve.models.hf_config import ModelConfig
from moeserve.models.weights import WeightSpec
from moeserve.ops.cpu import amx, amx_int8, kernels
from moeserve.ops.cpu import int8 as int8_kernels
from moeserve.ops.linear import linear, linear_into
from moeserve.quant.int8 import as_int8


def route_grouped_sigmoid(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (noaux_tc): sigmoid scores, group-limited top-k on score + bias.

    Groups are ranked by the sum of their two best biased scores; only the ``topk_group`` best
    groups may be chosen. Weights come from the unbiased scores. Returns (topk_w_TK fp32,
    topk_ids_TK).
    """
    scores_TE = logits_TE.sigmoid()
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    T, E = choice_TE.shape
    if n_group > 1 and topk_group < n_group:
        group_TG = choice_TE.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        keep_ids = group_TG.topk(topk_group, dim=-1, sorted=False)[1]
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, keep_ids, True)
        keep_TE = keep_TG.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
    topk_ids_TK = choice_TE.topk(top_k, dim=-1, sorted=False)[1]
    topk_w_TK = scores_TE.gather(1, topk_ids_TK)
    if norm_topk_prob:
        topk_w_TK = topk_w_TK / (topk_w_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_w_TK * scaling, topk_ids_TK


def route_softmax(
    logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-MoE routing: softmax over all experts, top-k, optional renormalisation."""
    probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
    topk_w_TK, topk_ids_TK = probs_TE.topk(top_k, dim=-1)
    if norm_topk_prob:
        topk_w_TK = topk_w_TK / topk_w_TK.sum(dim=-1, keepdim=True)
    return topk_w_TK, topk_ids_TK


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
            fast = kernels.route_grouped_sigmoid(*args, counts_E=counts_E, extra_id=extra_id)
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


def moe_reference(
    x_TD: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_w_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
) -> torch.Tensor:
    """Per-token, per-choice loop: the readable oracle for :func:`moe_grouped`."""
    F_ = w2_EDF.shape[2]
    y_TD = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(topk_ids_TK.shape[1]):
            e = int(topk_ids_TK[t, k])
            gate, up = (w13_EFD[e] @ x_TD[t]).split(F_)
            y_TD[t] += topk_w_TK[t, k].to(x_TD.dtype) * (w2_EDF[e] @ (F.silu(gate) * up))
    return y_TD


def experts_sorted(
    x_RD: torch.Tensor,
    weight_R: torch.Tensor,
    slot_counts: list[int] | tuple[int, ...],
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
) -> torch.Tensor:
    """Rows already sorted by expert: the first ``slot_counts[0]`` rows go to expert 0, the
    next ``slot_counts[1]`` to expert 1, and so on. Returns each row's expert output times its
    ``weight_R``, in the same order. One GEMM pair per expert that has rows. The weights may
    be int8 (``quant/int8.py``; w8a8_int8 ones quantize the rows and the hidden per row, in
    the AMX call or, without it, in each ``linear`` of the loop below)."""
    if x_RD.shape[0] == 0:
        return torch.empty_like(x_RD)
    experts = [e for e, n in enumerate(slot_counts) if n]
    counts = [slot_counts[e] for e in experts]
    q13, q2 = as_int8(w13_EFD), as_int8(w2_EDF)
    if q13 is not None and q2 is not None and q13.act_int8:
        if amx_int8.moe_usable(x_RD, counts, q13, q2):
            return amx_int8.moe_experts(x_RD, experts, counts, q13, q2, weight_R)
    elif q13 is not None and q2 is not None:
        if int8_kernels.moe_usable(x_RD, counts, q13, q2):
            return int8_kernels.moe_experts(x_RD, experts, counts, q13, q2, weight_R)
    elif kernels.moe_usable(x_RD, counts, w13_EFD, w2_EDF):
        return kernels.moe_experts(x_RD, experts, counts, w13_EFD, w2_EDF, weight_R)
    elif amx.moe_usable(x_RD, counts, w13_EFD, w2_EDF):
        return amx.moe_experts(x_RD, experts, counts, w13_EFD, w2_EDF, weight_R)
    y_RD = torch.empty_like(x_RD)
    F2 = w13_EFD.shape[1]
    start = 0
    for e, n in zip(experts, counts):
        end = start + n
        gate, up = linear(x_RD[start:end], w13_EFD[e]).split(F2 // 2, dim=-1)
        linear_into(F.silu(gate) * up, w2_EDF[e], out=y_RD[start:end])
        start = end
    return y_RD.mul_(weight_R.unsqueeze(1).to(y_RD.dtype))


def moe_grouped(
    x_TD: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_w_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
) -> torch.Tensor:
    """Sort (token, expert) pairs by expert, one GEMM pair per active expert, weighted scatter.

    ``w13_EFD`` holds gate rows then up rows (``[E, 2F, D]``), ``w2_EDF`` is ``[E, D, F]``.
    Expert ids must lie in ``[0, E)``.
    """
    T, K = topk_ids_TK.shape
    E = w13_EFD.shape[0]
    ids_R = topk_ids_TK.reshape(-1)
    if T == 1:
        # decode at batch 1: K experts, one row each; distinct, so sorting them is free
        ids = ids_R.tolist()
        order = sorted(range(K), key=ids.__getitem__)
        counts_E = [0] * E
        for e in ids:
            counts_E[e] += 1
        x_RD = x_TD.expand(K, x_TD.shape[1]).contiguous()
        weight_R = topk_w_TK.reshape(-1)[order]
        return experts_sorted(x_RD, weight_R, counts_E, w13_EFD, w2_EDF).sum(dim=0, keepdim=True)
    order_R = ids_R.argsort(stable=True)
    counts_E = torch.bincount(ids_R, minlength=E).tolist()
    token_R = order_R // K
    x_RD = x_TD.index_select(0, token_R)
    weight_R = topk_w_TK.reshape(-1)[order_R]
    y_RD = experts_sorted(x_RD, weight_R, counts_E, w13_EFD, w2_EDF)
    return torch.zeros_like(x_TD).index_add_(0, token_R, y_RD)


class FusedExperts(nn.Module):
    """The routed experts this rank holds, stacked by local slot: ``w13_EFD [S, 2F, D]`` (gate
    rows then up rows), ``w2_EDF [S, D, F]``.

    ``slot_experts[s]`` is the logical (checkpoint) expert in local slot s: all experts in
    order on one process, this rank's share under expert parallelism (a logical expert may
    fill several slots). Under tensor parallelism without EP, each slot holds F / tp of its
    expert's FFN (``tp``): gate and up rows ``[r * F/tp, (r + 1) * F/tp)``, the same down
    columns, and the layer's output is a partial sum.
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

    def forward(
        self, x_TD: torch.Tensor, topk_w_TK: torch.Tensor, topk_ids_TK: torch.Tensor
    ) -> torch.Tensor:
        """All experts local, slot e = expert e."""
        return moe_grouped(x_TD, self.w13_EFD, self.w2_EDF, topk_w_TK, topk_ids_TK)

    def compute_sorted(
        self, x_RD: torch.Tensor, weight_R: torch.Tensor, slot_counts: list[int] | tuple[int, ...]
    ) -> torch.Tensor:
        return experts_sorted(x_RD, weight_R, slot_counts, self.w13_EFD, self.w2_EDF)

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        slots: dict[int, list[int]] = {}
        for s, e in enumerate(self.slot_experts):
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
