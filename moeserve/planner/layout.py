"""A parallel layout of one serving instance, and the enumeration of the candidates.

Names follow docs/parallelism.md: ``tp`` splits heads, dense FFNs and the vocabulary inside a
TP group; ``dp`` DP-attention replicas per pipeline stage, each with its own requests and KV
cache; with ``expert_parallel`` the routed experts are split over the ``tp x dp`` ranks of a
stage (EP size = tp x dp), otherwise each rank holds ``F / tp`` of every expert; ``pp``
pipeline stages. ``redundant_experts`` adds copies of hot experts (EPLB),
``two_batch_overlap`` splits each step into two micro-batches, ``mtp_depth`` draft tokens per
step from the MTP module(s), each accepted with probability ``mtp_acceptance``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from moeserve.planner.model_spec import ModelSpec


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    pp: int = 1
    expert_parallel: bool = False
    redundant_experts: int = 0
    two_batch_overlap: bool = False
    mtp_depth: int = 0
    mtp_acceptance: float = 0.0
    nodes: int = 1  # nodes this instance spans

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout: {name} must be >= 1, got {getattr(self, name)}")
        if self.redundant_experts < 0 or self.mtp_depth < 0:
            raise ValueError("layout: redundant_experts and mtp_depth must be >= 0")
        if self.redundant_experts and not self.expert_parallel:
            raise ValueError("layout: redundant experts need expert parallelism")
        if not 0 <= self.mtp_acceptance <= 1:
            raise ValueError(f"layout: mtp_acceptance must be in [0, 1], got {self.mtp_acceptance}")
        if self.world % self.nodes:
            raise ValueError(f"layout: {self.world} ranks do not split over {self.nodes} nodes")

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def ep(self) -> int:
        return self.tp * self.dp if self.expert_parallel else 1

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nodes

    @property
    def tokens_per_step(self) -> float:
        """Expected tokens a sequence gains per decode step: the sampled one plus the run of
        accepted drafts (draft i survives only if drafts 1..i all did)."""
        a = self.mtp_acceptance
        return sum(a**i for i in range(self.mtp_depth + 1))

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"dp{self.dp}"]
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        parts.append(f"ep{self.ep}" if self.expert_parallel else "no-ep")
        if self.redundant_experts:
            parts.append(f"r{self.redundant_experts}")
        if self.two_batch_overlap:
            parts.append("tbo")
        if self.mtp_depth:
            parts.append(f"mtp{self.mtp_depth}")
        return "-".join(parts) + f" ({self.nodes} node{'s' if self.nodes > 1 else ''})"


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def enumerate_layouts(
    spec: ModelSpec,
    nodes: int,
    devices_per_node: int,
    *,
    instance_nodes: list[int] | None = None,
    mtp_acceptance: float = 0.8,
    max_mtp_depth: int | None = None,
    max_pp: int = 8,
    redundant_choices: tuple[int, ...] | None = None,
) -> list[Layout]:
    """Every layout of one instance that spans ``instance_nodes`` (default: every divisor of
    ``nodes``, so the cluster holds ``nodes / n`` copies) and uses all its devices.

    TP stays inside a node and divides the heads; PP divides the layers; EP needs the experts
    (plus redundant copies) to split evenly over the EP ranks. MTP depth runs from 0 to the
    model's MTP layers (or ``max_mtp_depth``)."""
    sizes = instance_nodes or [n for n in range(1, nodes + 1) if nodes % n == 0]
    mtp_max = spec.num_mtp_layers if max_mtp_depth is None else max_mtp_depth
    out: list[Layout] = []
    for n in sizes:
        world = n * devices_per_node
        for tp, pp in itertools.product(_pow2_upto(devices_per_node), _pow2_upto(max_pp)):
            if world % (tp * pp) or spec.num_heads % tp or pp > spec.num_layers:
                continue
            dp = world // (tp * pp)
            for ep_on in (False, True):
                ep = tp * dp if ep_on else 1
                if ep_on and ep == 1:
                    continue
                # the fewest extra slots that make experts split evenly, and one slot more
                # per rank (EPLB's copies of hot experts)
                r0 = (-spec.num_experts) % ep
                choices = (0,) if not ep_on else (redundant_choices or (r0, r0 + ep))
                for r in choices:
                    if ep_on and (spec.num_experts + r) % ep:
                        continue
                    for tbo, depth in itertools.product((False, True), range(mtp_max + 1)):
                        out.append(
                            Layout(
                                tp=tp,
                                dp=dp,
                                pp=pp,
                                expert_parallel=ep_on,
                                redundant_experts=r,
                                two_batch_overlap=tbo,
                                mtp_depth=depth,
                                mtp_acceptance=mtp_acceptance if depth else 0.0,
                                nodes=n,
                            )
                        )
    return out
