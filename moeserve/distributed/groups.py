"""Process groups, built once per world and handed to layers explicitly.

An :class:`Axis` is this rank's view of one group: its size, its index in it, the world ranks
in it and the torch.distributed group. Collectives on an axis of size 1 do nothing, so a
single-process model runs the same code with :meth:`ParallelGroups.single`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moeserve.distributed.parallel_dims import ParallelDims, RankCoords


@dataclass(frozen=True)
class Axis:
    name: str
    size: int
    rank: int  # this rank's index inside the group
    ranks: tuple[int, ...]  # world ranks of the group, in index order
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def single(name: str, world_rank: int = 0) -> Axis:
        return Axis(name, 1, 0, (world_rank,), None)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns ``t``."""
        if self.size > 1 and t.numel():
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate equal-shaped pieces from every member along ``dim``, in index order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src_index: int = 0) -> torch.Tensor:
        """In place from the member at ``src_index``; returns ``t``."""
        if self.size > 1:
            dist.broadcast(t, src=self.ranks[src_index], group=self.group)
        return t


@dataclass(frozen=True)
class ParallelGroups:
    dims: ParallelDims
    coords: RankCoords
    tp: Axis
    ep: Axis  # the stage's expert-parallel group (size 1 without EP)
    pp: Axis  # this (dp, tp) position's stages
    replica: Axis  # the tp x pp ranks of this DP replica
    world: Axis

    @property
    def rank(self) -> int:
        return self.coords.rank

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp_rank == self.dims.pp - 1

    @property
    def is_replica_leader(self) -> bool:
        return self.replica.rank == self.replica_leader_index

    @property
    def replica_leader_index(self) -> int:
        """Index in ``replica`` of the rank that samples: last stage, tp rank 0."""
        return self.replica.ranks.index(self.dims.rank_of(self.coords.dp_rank, self.dims.pp - 1, 0))

    def without_handles(self) -> ParallelGroups:
        """The same coordinates without the process groups (elastic EP, as a group fails: a
        group's connections close only once nothing holds it)."""
        return ParallelGroups(
            self.dims,
            self.coords,
            *(dataclasses.replace(a, group=None) for a in (self.tp, self.ep, self.pp)),
            dataclasses.replace(self.replica, group=None),
            dataclasses.replace(self.world, group=None),
        )

    @staticmethod
    def single() -> ParallelGroups:
        dims = ParallelDims()
        return ParallelGroups(
            dims,
            dims.coords(0),
            Axis.single("tp"),
            Axis.single("ep"),
            Axis.single("pp"),
            Axis.single("replica"),
            Axis.single("world"),
        )

    @staticmethod
    def build(dims: ParallelDims) -> ParallelGroups:
        """Create every group of every axis (all ranks must call this, in the same order) and
        keep this rank's. Needs an initialised default process group of ``dims.world_size``."""
        if dims.world_size == 1:
            return ParallelGroups.single()
        if not dist.is_initialized():
            raise RuntimeError("ParallelGroups.build needs torch.distributed initialised first")
        if dist.get_world_size() != dims.world_size:
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks but {dims.describe()} "
                f"needs {dims.world_size}"
            )
        rank = dist.get_rank()
        coords = dims.coords(rank)

        def axis(name: str, groups: list[list[int]]) -> Axis:
            mine = None
            for ranks in groups:
                # new_group is collective over the world: every rank creates every group
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    mine = Axis(name, len(ranks), ranks.index(rank), tuple(ranks), group)
            assert mine is not None, f"rank {rank} is in no {name} group"
            return mine

        tp = axis("tp", dims.tp_groups())
        ep = (
            axis("ep", dims.ep_groups()) if dims.enable_expert_parallel else Axis.single("ep", rank)
        )
        pp = axis("pp", dims.pp_groups())
        replica = axis("replica", dims.replica_groups())
        world = Axis(
            "world", dims.world_size, rank, tuple(range(dims.world_size)), dist.group.WORLD
        )
        return ParallelGroups(dims, coords, tp, ep, pp, replica, world)
