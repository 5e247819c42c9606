"""The parallel layout: how many ranks along each axis and where a rank sits.

Axes (per pipeline stage)::

    tp  tensor parallel: attention heads, dense FFN columns, vocabulary, split inside a group
    dp  data parallel attention: each DP replica owns its requests and KV cache
    ep  expert parallel: the routed experts split over all tp x dp ranks of a stage (EP = TP x DP)
    pp  pipeline parallel: consecutive layers per stage

World ranks are ordered ``(dp, pp, tp)`` with tp fastest, so a TP group is a run of
consecutive ranks (one host, when ranks are placed host by host)::

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int  # index inside the stage's EP group (dp_rank * tp + tp_rank); 0 without EP


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    dp: int = 1
    pp: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def ep(self) -> int:
        """Ranks the routed experts of one stage are split over (1 without expert parallelism:
        then each TP group holds every expert, TP-sharded)."""
        return self.tp * self.dp if self.enable_expert_parallel else 1

    def describe(self) -> str:
        return f"tp={self.tp} dp={self.dp} pp={self.pp} ep={self.ep} (world {self.world_size})"

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ({self})")
        tp_rank = rank % self.tp
        pp_rank = (rank // self.tp) % self.pp
        dp_rank = rank // (self.tp * self.pp)
        ep_rank = dp_rank * self.tp + tp_rank if self.enable_expert_parallel else 0
        return RankCoords(rank, tp_rank, dp_rank, pp_rank, ep_rank)

    # -- group membership: every group of each axis, in a fixed order --------------------------

    def tp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(d, p, t) for t in range(self.tp)]
            for d in range(self.dp)
            for p in range(self.pp)
        ]

    def ep_groups(self) -> list[list[int]]:
        """One per stage: all tp x dp ranks of it (ordered by ep_rank)."""
        return [
            [self.rank_of(d, p, t) for d in range(self.dp) for t in range(self.tp)]
            for p in range(self.pp)
        ]

    def pp_groups(self) -> list[list[int]]:
        """The stages of one (dp, tp) position, first to last."""
        return [
            [self.rank_of(d, p, t) for p in range(self.pp)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def replica_groups(self) -> list[list[int]]:
        """One per DP replica: its tp x pp ranks, which run the same batches."""
        return [
            [self.rank_of(d, p, t) for p in range(self.pp) for t in range(self.tp)]
            for d in range(self.dp)
        ]

    def check_model(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        num_experts: int,
        num_layers: int,
        ffn_sizes: tuple[int, ...],
        num_redundant_experts: int = 0,
    ) -> None:
        """Raise ValueError when the model cannot be split this way, saying which size."""
        problems = []
        if num_heads % self.tp:
            problems.append(f"{num_heads} attention heads do not divide by tp={self.tp}")
        if num_kv_heads % self.tp and self.tp % num_kv_heads:
            problems.append(f"{num_kv_heads} KV heads neither divide by tp={self.tp} nor divide it")
        if self.pp > num_layers:
            problems.append(f"pp={self.pp} exceeds the {num_layers} layers")
        if self.enable_expert_parallel and (num_experts + num_redundant_experts) % self.ep:
            problems.append(
                f"{num_experts + num_redundant_experts} expert slots do not divide by "
                f"ep={self.ep} (tp x dp)"
            )
        for f in sorted(set(ffn_sizes)):
            if f % self.tp:
                problems.append(f"FFN size {f} does not divide by tp={self.tp}")
        if problems:
            raise ValueError(
                f"cannot split the model with {self.describe()}: " + "; ".join(problems)
            )
