"""What one failure costs: the recovery of a survived loss (:func:`loss_cost`), or a full
restart (:func:`restart_seconds`).

A survived loss: the others (a) detect it, (b) re-form their process groups, (c) re-place the
experts over the live ranks, reading every expert left without a live copy from the checkpoint
into a slot that held a second copy of another, and (d) recompute the KV of every in-flight
request (its prompt plus the tokens already sent) on the survivors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moeserve.planner.availability.failure_model import FailureModel, domain_ranks
from moeserve.planner.availability.placement import missing_per_domain, slots_per_rank
from moeserve.planner.cost_model import Rank
from moeserve.planner.hardware import HardwareProfile
from moeserve.planner.layout import Layout
from moeserve.planner.memory import rank_memory, stage_weight_bytes
from moeserve.planner.model_spec import ModelSpec
from moeserve.planner.search import Workload
from moeserve.planner.simulator import prefill_step


def elastic_reason(layout: Layout) -> str:
    """Empty when elastic EP can survive a loss in ``layout``; otherwise why every loss is a
    full restart."""
    if not layout.expert_parallel or layout.tp != 1 or layout.pp != 1:
        return "elastic EP needs EP, TP 1 and PP 1"
    if layout.dp < 2:
        return "one EP rank: nothing survives its loss"
    return ""


@dataclass(frozen=True)
class LossCost:
    """One failure of a domain other than rank 0's: what recovery takes, and whether the
    survivors can hold every expert (``slots_hold``) and the in-flight requests
    (``kv_holds``). Missing experts: mean and worst over those domains (contiguous placement),
    and the bound for any placement (every slot of the lost ranks a sole copy)."""

    unit: str
    ranks_lost: int
    detect_s: float
    regroup_s: float
    missing_experts_mean: float
    missing_experts_worst: int
    missing_experts_bound: int
    expert_bytes: float  # one expert over every MoE layer, at the weight dtype
    read_bytes_per_s: float
    recompute_tokens: float
    recompute_s: float
    survivor_batch: int  # sequences per surviving replica
    slots_hold: bool
    kv_holds: bool

    @property
    def reload_bytes_mean(self) -> float:
        return self.missing_experts_mean * self.expert_bytes

    @property
    def reload_bytes_worst(self) -> float:
        return self.missing_experts_worst * self.expert_bytes

    @property
    def survives(self) -> bool:
        return self.slots_hold and self.kv_holds

    @property
    def recovery_s(self) -> float:
        reload = self.reload_bytes_mean / self.read_bytes_per_s
        return self.detect_s + self.regroup_s + reload + self.recompute_s

    @property
    def recovery_s_worst(self) -> float:
        reload = self.reload_bytes_worst / self.read_bytes_per_s
        return self.detect_s + self.regroup_s + reload + self.recompute_s

    @property
    def reason(self) -> str:
        if not self.slots_hold:
            return "too few slots for the experts"
        if not self.kv_holds:
            return "the requests' KV does not fit"
        return ""

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for name in _LOSS_PROPERTIES:
            out[name] = getattr(self, name)
        return out


_LOSS_PROPERTIES = (
    "reload_bytes_mean",
    "reload_bytes_worst",
    "survives",
    "recovery_s",
    "recovery_s_worst",
    "reason",
)


def workload_rank(hw: HardwareProfile, layout: Layout, w: Workload) -> Rank:
    """One rank of ``layout`` on ``hw`` at the workload's dtypes."""
    return Rank.of(hw, layout, w.weight_dtype, w.compute_dtype, w.kv_dtype)


def loss_cost(
    spec: ModelSpec,
    hw: HardwareProfile,
    layout: Layout,
    w: Workload,
    in_flight: int,
    fm: FailureModel | None = None,
    unit: str = "rank",
) -> LossCost:
    """The cost of losing one rank (``unit="rank"``) or one node other than rank 0's, with
    ``in_flight`` requests in the whole instance. Raises ValueError for a layout elastic EP
    cannot recover (:func:`elastic_reason`), a one-node instance's node loss, or a bad count."""
    fm = fm or FailureModel()
    why = elastic_reason(layout)
    if why:
        raise ValueError(f"{layout.describe()}: {why}")
    if in_flight < 0:
        raise ValueError(f"in_flight must be >= 0, got {in_flight}")
    group = domain_ranks(layout, unit)
    if group == layout.ep:
        raise ValueError(f"{layout.describe()}: a node loss takes rank 0 (a full restart)")
    E, R, ep = spec.num_experts, layout.redundant_experts, layout.ep
    S = slots_per_rank(E, R, ep)
    per_domain = missing_per_domain(E, R, ep, group)[1:]  # domain 0 holds rank 0: a restart
    rank = workload_rank(hw, layout, w)
    layers = spec.num_moe_layers + (spec.num_mtp_layers if layout.mtp_depth else 0)
    survivors = ep - group
    ctx = w.input_len + w.output_len / 2  # mean tokens of a request in flight
    per = math.ceil(in_flight / survivors)
    return LossCost(
        unit=unit,
        ranks_lost=group,
        detect_s=fm.detect_s,
        regroup_s=fm.regroup_s,
        missing_experts_mean=sum(per_domain) / len(per_domain),
        missing_experts_worst=max(per_domain),
        missing_experts_bound=min(group * S, E),
        expert_bytes=spec.expert_params() * layers * rank.wbytes,
        read_bytes_per_s=fm.checkpoint_read_gbs * 1e9,
        recompute_tokens=in_flight * ctx,
        recompute_s=_recompute_s(spec, rank, w, per, ctx),
        survivor_batch=per,
        slots_hold=survivors * S >= E,
        kv_holds=_kv_holds(spec, rank, w, per),
    )


def _recompute_s(spec: ModelSpec, rank: Rank, w: Workload, seqs: int, ctx: float) -> float:
    """A survivor prefills its ``seqs`` requests of ``ctx`` tokens in steps of at most
    ``max_prefill_tokens`` (one request at least), every survivor at once."""
    chunk = max(1, int(w.max_prefill_tokens // ctx))
    full, rest = divmod(seqs, chunk)
    t = full * prefill_step(rank, spec, chunk, ctx, 0.0, w.imbalance).time_s if full else 0.0
    if rest:
        t += prefill_step(rank, spec, rest, ctx, 0.0, w.imbalance).time_s
    return t


def _kv_holds(spec: ModelSpec, rank: Rank, w: Workload, seqs: int) -> bool:
    tokens = seqs * (1 + rank.layout.mtp_depth)
    return rank_memory(rank, spec, seqs, w.input_len + w.output_len, tokens, tokens).fits


def restart_seconds(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, w: Workload, fm: FailureModel
) -> float:
    """A full restart: ``fm.restart_s``, or the fixed part plus the node's weights (its ranks'
    heaviest stage) read at ``checkpoint_read_gbs``."""
    if fm.restart_s is not None:
        return fm.restart_s
    node_bytes = layout.ranks_per_node * stage_weight_bytes(workload_rank(hw, layout, w), spec)
    return fm.restart_fixed_s + node_bytes / (fm.checkpoint_read_gbs * 1e9)
