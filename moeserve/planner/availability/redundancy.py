"""The redundant experts a layout needs to survive K losses, and what they cost per rank."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeserve.planner.availability.failure_model import domain_ranks
from moeserve.planner.availability.loss import workload_rank
from moeserve.planner.availability.placement import expert_domains
from moeserve.planner.hardware import HardwareProfile
from moeserve.planner.layout import Layout
from moeserve.planner.memory import MemoryUse, stage_weight_bytes
from moeserve.planner.model_spec import ModelSpec
from moeserve.planner.search import Workload


@dataclass(frozen=True)
class RedundancyOption:
    redundant_experts: int | None  # None: no count is enough
    extra_weight_bytes_per_rank: float  # against the layout's (negative: fewer slots)
    fits: bool | None  # with the plan's memory in use; None: not asked


@dataclass(frozen=True)
class Redundancy:
    """Redundant experts per layer for ``failures`` losses of a ``unit``, simultaneous or one
    after another before a rejoin: ``survive``, the fewest that let the survivors' slots hold
    every expert (with reloads); ``no_reload``, the fewest that leave every expert a live
    copy (each expert on ``failures + 1`` domains)."""

    failures: int
    unit: str
    layout_redundant: int
    survive: RedundancyOption
    no_reload: RedundancyOption

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        parts = []
        for name, o in (("survive", self.survive), ("no reload", self.no_reload)):
            if o.redundant_experts is None:
                parts.append(f"{name}: no count is enough")
                continue
            fits = {True: "fits", False: "does not fit", None: "fit not checked"}[o.fits]
            gb = o.extra_weight_bytes_per_rank / 1e9
            parts.append(f"{name} r{o.redundant_experts} ({gb:+.2f} GB/rank, {fits})")
        return f"{self.failures} {self.unit} loss(es): " + "; ".join(parts)


def redundancy_needed(
    spec: ModelSpec,
    hw: HardwareProfile,
    layout: Layout,
    failures: int,
    unit: str = "rank",
    w: Workload | None = None,
    memory: MemoryUse | None = None,
) -> Redundancy:
    """Redundant experts ``layout`` needs for ``failures`` losses (see :class:`Redundancy`),
    and what they cost per rank; ``memory``: the rank's use now, to say whether they fit.
    Raises ValueError for ``failures < 1`` or a layout without EP."""
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
        raise ValueError(f"failures to tolerate must be an integer >= 1, got {failures!r}")
    if not layout.expert_parallel:
        raise ValueError(f"{layout.describe()}: redundant experts need expert parallelism")
    group = domain_ranks(layout, unit)
    E, ep = spec.num_experts, layout.ep
    domains = ep // group
    w = w or Workload(1, 1)
    s0 = -(-E // ep)
    survive = no_reload = None
    if domains > failures:
        # S grows until (domains - failures) domains hold E slots; and until each expert
        # lies in failures + 1 domains, which holds at the latest once a domain spans E
        # slots (every window of E consecutive slots holds every expert)
        survive = ep * -(-E // ((domains - failures) * group)) - E
        S = s0
        while any(len(d) <= failures for d in expert_domains(E, ep * S - E, ep, group)):
            S += 1
        no_reload = ep * S - E

    def option(r: int | None) -> RedundancyOption:
        if r is None:
            return RedundancyOption(None, 0.0, None)
        now = stage_weight_bytes(workload_rank(hw, layout, w), spec)
        new = dataclasses.replace(layout, redundant_experts=r)
        extra = stage_weight_bytes(workload_rank(hw, new, w), spec) - now
        fits = None if memory is None else memory.total + extra <= memory.capacity
        return RedundancyOption(r, extra, fits)

    return Redundancy(failures, unit, layout.redundant_experts, option(survive), option(no_reload))
