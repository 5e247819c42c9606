"""The time an instance spends serving at full capacity, degraded, and down, from the failure
rate and what each failure costs (a renewal model; formulas: docs/scaling.md, "Availability
under rank loss")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeserve.planner.availability.failure_model import FailureModel
from moeserve.planner.availability.loss import (
    LossCost,
    elastic_reason,
    loss_cost,
    restart_seconds,
)
from moeserve.planner.hardware import HardwareProfile
from moeserve.planner.layout import Layout
from moeserve.planner.model_spec import ModelSpec
from moeserve.planner.search import Workload


@dataclass(frozen=True)
class Availability:
    """Time fractions of one instance: serving at full capacity, degraded (a domain lost
    until its replacement rejoins), and down (recovering or restarting)."""

    elastic_reason: str  # "" when elastic recovery applies
    instance_mtbf_hours: float
    period_days: float
    restart_s: float  # detection included
    restart_probability: float  # of a failure, that it ends the service
    down_s_per_failure: float
    degraded_s_per_failure: float
    full_fraction: float
    degraded_fraction: float
    down_fraction: float
    capacity_fraction: float  # time-averaged share of the full throughput
    rank_loss: LossCost | None
    node_loss: LossCost | None

    @property
    def failures_per_period(self) -> float:
        return self.period_days * 24 / self.instance_mtbf_hours

    @property
    def down_s_per_period(self) -> float:
        return self.down_fraction * self.period_days * 86400

    def as_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if not k.endswith("_loss")}
        out["failures_per_period"] = self.failures_per_period
        out["down_s_per_period"] = self.down_s_per_period
        for name in ("rank_loss", "node_loss"):
            loss = getattr(self, name)
            out[name] = loss.as_dict() if loss else None
        return out


def availability(
    spec: ModelSpec,
    hw: HardwareProfile,
    layout: Layout,
    w: Workload,
    in_flight: int,
    fm: FailureModel | None = None,
) -> Availability:
    """Expected fractions of time for ``layout`` under ``fm`` (renewal model: a failure every
    ``node_mtbf / nodes`` hours, each followed by its down time; a second failure while
    degraded is not modelled, so it holds while ``rejoin_s`` is far below the instance MTBF)."""
    fm = fm or FailureModel()
    restart = fm.detect_s + restart_seconds(spec, hw, layout, w, fm)
    rejoin = restart - fm.detect_s if fm.rejoin_s is None else fm.rejoin_s
    why = elastic_reason(layout)
    pr, rank_loss, node_loss = fm.rank_fault_fraction, None, None
    events = [(1.0, None)]  # (probability, loss; None: a full restart)
    if not why:
        rank_loss = loss_cost(spec, hw, layout, w, in_flight, fm, "rank")
        events = [(pr / layout.world, None), (pr * (1 - 1 / layout.world), rank_loss)]
        if layout.nodes > 1:
            node_loss = loss_cost(spec, hw, layout, w, in_flight, fm, "node")
            q = 1 - pr
            events += [(q / layout.nodes, None), (q * (1 - 1 / layout.nodes), node_loss)]
        else:
            events.append((1 - pr, None))
    down = degraded = lost = p_restart = 0.0
    for p, loss in events:
        if loss is None or not loss.survives:
            down, p_restart = down + p * restart, p_restart + p
            continue
        down += p * loss.recovery_s
        degraded += p * rejoin
        lost += p * rejoin * loss.ranks_lost / layout.dp
    mtbf_h = fm.node_mtbf_hours / layout.nodes
    cycle = mtbf_h * 3600 + down
    down_f = down / cycle
    scale = min(1.0, (1 - down_f) / (degraded / cycle)) if degraded else 1.0
    return Availability(
        elastic_reason=why,
        instance_mtbf_hours=mtbf_h,
        period_days=fm.period_days,
        restart_s=restart,
        restart_probability=p_restart,
        down_s_per_failure=down,
        degraded_s_per_failure=degraded,
        full_fraction=1 - down_f - degraded / cycle * scale,
        degraded_fraction=degraded / cycle * scale,
        down_fraction=down_f,
        capacity_fraction=1 - down_f - lost / cycle * scale,
        rank_loss=rank_loss,
        node_loss=node_loss,
    )
