"""Expert placement: which logical expert each physical expert slot of one MoE layer holds.

Shape legend: T tokens, K top-k, E logical experts, P physical slots, S slots per rank,
X most replicas of one logical expert.

Slots are laid out rank-major; rank ``r`` owns ``[r*S, (r+1)*S)``::

    phys2log_P  = [0 1 2 3 | 4 5 6 7 | 0 1 2 3]   E=8, P=12, ep_size=3, S=4
                   rank 0    rank 1    rank 2
    log2phys_EX = [[0 8] [1 9] [2 10] [3 11] [4 -1] [5 -1] [6 -1] [7 -1]]
    logcnt_E    = [2 2 2 2 1 1 1 1]

``log2phys``/``logcnt`` have the meaning and shape of DeepSeek's EPLB output for one layer.
With replicas, :meth:`physical_ids` asks ``replica.ReplicaTable`` which one serves each choice:
a replica on the token's own node first (``node_of_rank``), then round-robin over the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from moeserve.distributed.ep.replica import ReplicaTable

# a local slot that holds no expert yet: a replacement rank's, from its start until the
# members fill it over the network as it joins (elastic EP: ``engine/regroup.py``)
EMPTY_SLOT = -1


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """The slot -> logical expert table of one layer and the EP size it is cut for.

    Raises ValueError when ``P`` does not divide by ``ep_size``, when an id is negative, or when
    a logical expert in ``0..max(id)`` has no slot. ``phys2log_P`` is stored as an int64 copy.
    """

    phys2log_P: torch.Tensor
    ep_size: int
    node_of_rank: tuple[int, ...] | None = None  # node of each EP rank; None: one node

    def __post_init__(self) -> None:
        table = torch.as_tensor(self.phys2log_P, dtype=torch.int64).flatten().clone()
        object.__setattr__(self, "phys2log_P", table)
        P = table.numel()
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {self.ep_size}")
        if self.node_of_rank is not None:
            nodes = tuple(int(n) for n in self.node_of_rank)
            if len(nodes) != self.ep_size or min(nodes) < 0:
                raise ValueError(
                    f"node_of_rank must give a node >= 0 for each of the {self.ep_size} EP "
                    f"ranks, got {nodes}"
                )
            object.__setattr__(self, "node_of_rank", nodes)
        if P == 0 or P % self.ep_size:
            raise ValueError(
                f"{P} physical slots do not split evenly over ep_size={self.ep_size} ranks; "
                "add or remove redundant slots so that P % ep_size == 0"
            )
        if int(table.min()) < 0:
            raise ValueError(f"phys2log_P holds negative expert ids: {table.tolist()}")
        missing = (torch.bincount(table) == 0).nonzero().flatten().tolist()
        if missing:
            raise ValueError(
                f"logical experts {missing} have no physical slot; every expert "
                f"0..{int(table.max())} needs at least one"
            )

    @classmethod
    def contiguous(
        cls,
        num_logical: int,
        ep_size: int,
        num_redundant: int = 0,
        node_of_rank: tuple[int, ...] | None = None,
    ) -> ExpertPlacement:
        """Expert ``e`` in slot ``e``; redundant slots ``E + i`` hold copies of expert ``i % E``.

        Raises ValueError when ``ep_size`` does not divide ``num_logical + num_redundant``.
        """
        if num_logical < 1 or num_redundant < 0:
            raise ValueError(
                f"need num_logical >= 1 and num_redundant >= 0, got {num_logical}, {num_redundant}"
            )
        P = num_logical + num_redundant
        if P % ep_size:
            raise ValueError(
                f"ep_size={ep_size} does not divide {num_logical} experts + {num_redundant} "
                f"redundant slots = {P}"
            )
        table = torch.cat([torch.arange(num_logical), torch.arange(num_redundant) % num_logical])
        return cls(table, ep_size, node_of_rank)

    def with_table(self, phys2log_P: torch.Tensor) -> ExpertPlacement:
        """The same ranks and nodes holding another slot table (an EPLB re-placement)."""
        return ExpertPlacement(phys2log_P, self.ep_size, self.node_of_rank)

    @property
    def num_physical(self) -> int:
        return self.phys2log_P.numel()

    @property
    def num_logical(self) -> int:
        return int(self.phys2log_P.max()) + 1

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    @cached_property
    def logcnt(self) -> torch.Tensor:
        """``[E]`` int64: how many slots hold each logical expert."""
        return torch.bincount(self.phys2log_P, minlength=self.num_logical)

    @cached_property
    def log2phys(self) -> torch.Tensor:
        """``[E, X]`` int64: the slots of each logical expert in ascending order, -1 padded."""
        E, X = self.num_logical, int(self.logcnt.max())
        out = torch.full((E, X), -1, dtype=torch.int64)
        order_P = self.phys2log_P.argsort(stable=True)  # slots grouped by expert, ascending
        start_E = torch.cumsum(self.logcnt, 0) - self.logcnt
        replica_P = torch.arange(self.num_physical) - start_E[self.phys2log_P[order_P]]
        out[self.phys2log_P[order_P], replica_P] = order_P
        return out

    def local_logical(self, rank: int) -> list[int]:
        """The logical expert of each of ``rank``'s ``S`` slots, in slot order."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank {rank} outside [0, {self.ep_size})")
        S = self.slots_per_rank
        return self.phys2log_P[rank * S : (rank + 1) * S].tolist()

    @cached_property
    def is_identity(self) -> bool:
        """Slot ``e`` holds expert ``e`` and no expert has a replica: a choice's slot is its
        expert id."""
        return bool(torch.equal(self.phys2log_P, torch.arange(self.num_physical)))

    @cached_property
    def replica_table(self) -> ReplicaTable:
        """The table :meth:`physical_ids` selects replicas with (built once)."""
        nodes = self.node_of_rank or (0,) * self.ep_size
        return ReplicaTable.build(
            self.log2phys, self.logcnt, self.slots_per_rank, torch.tensor(nodes)
        )

    def physical_ids(
        self, topk_ids_TK: torch.Tensor, offset: int = 0, own_rank: int = 0
    ) -> torch.Tensor:
        """Map logical choices to slots. Without replicas a plain lookup; with them
        ``ReplicaTable.select``: a replica on ``own_rank``'s node when there is one, and the
        ``i``-th choice of an expert from this rank takes pool member
        ``(i + own_rank + offset) % len(pool)``, so a batch spreads evenly over the replicas
        and ranks start at different ones. A pure function of its arguments. Raises
        ValueError for ids outside ``[0, E)``."""
        if topk_ids_TK.numel() == 0:
            return torch.empty_like(topk_ids_TK, dtype=torch.int64)
        device = topk_ids_TK.device
        ids_TK = topk_ids_TK.long().cpu()  # the tables live on the host
        lo, hi = int(ids_TK.min()), int(ids_TK.max())
        if lo < 0 or hi >= self.num_logical:
            raise ValueError(
                f"expert ids must lie in [0, {self.num_logical}), got min {lo}, max {hi}"
            )
        if self.log2phys.shape[1] == 1:  # no replicas: a plain lookup
            return self.log2phys[:, 0][ids_TK].to(device)
        phys_TK = self.replica_table.select(ids_TK, own_rank, offset, validate=False)
        return phys_TK.to(device)
