"""Which physical replica serves each routed choice: node affinity first, then even spreading.

Shape legend: T tokens, K top-k, E logical experts, X most replicas of one expert, P physical
slots, S slots per rank, R ranks.

For choice ``(t, k)`` of expert ``e``, the candidates are ``e``'s slots (``log2phy_EX[e]``,
valid where ``>= 0``). The pool is the candidates on the token's own node when there is one,
else all of them. Inside each ``(own rank, expert)`` pair the choices are numbered in
row-major ``(t, k)`` order (``occurrence``), and choice number ``i`` takes pool member
``(i + own_rank + offset) % len(pool)``::

    log2phy[e] = [3, 9, 12, -1]   S=4: ranks 0, 2, 3; node_of_rank = [0, 0, 1, 1]
    own rank 1 (node 0): pool [3]        -> every choice of e goes to slot 3
    own rank 2 (node 1): pool [9, 12]    -> choices of e go to 9, 12, 9, 12, ...
    own rank 3 (node 1): pool [9, 12]    -> choices of e go to 12, 9, 12, 9, ...

So one batch's choices of an expert differ by at most one between the members of its pool,
ranks start at different members, and the result is a pure function of the arguments.

A dispatcher builds one :class:`ReplicaTable` per layer when the placement changes (it checks
the tables and keeps only the columns some expert uses) and calls :meth:`ReplicaTable.select`
each step; :func:`select_replicas` does both in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ReplicaTable:
    """One layer's replicas: ``log2phy_EX`` (slots of each expert, -1 padded, only as many
    columns as the most replicated expert needs), ``node_EX`` (the node of each of those
    slots, -1 for padding) and ``node_of_rank_R``. Build it with :meth:`build`."""

    log2phy_EX: torch.Tensor
    node_EX: torch.Tensor
    node_of_rank_R: torch.Tensor

    @classmethod
    def build(
        cls,
        log2phy_EX: torch.Tensor,
        logcnt_E: torch.Tensor,
        slots_per_rank: int,
        node_of_rank_R: torch.Tensor,
        device: torch.device | str | None = None,
    ) -> ReplicaTable:
        """Check and prepare one layer's tables (rank of slot ``p`` is ``p // slots_per_rank``).

        Raises ValueError when ``log2phy`` is not ``[E, X]`` with ``logcnt`` ``[E]``, when
        they disagree or an expert has no replica, or when a slot lies outside
        ``[0, R * slots_per_rank)``."""
        log2phy_EX = torch.as_tensor(log2phy_EX).to("cpu", torch.int64)
        logcnt_E = torch.as_tensor(logcnt_E).to("cpu", torch.int64)
        node_of_rank_R = torch.as_tensor(node_of_rank_R).to("cpu", torch.int64).flatten()
        R = node_of_rank_R.numel()
        if log2phy_EX.dim() != 2 or logcnt_E.shape != log2phy_EX.shape[:1]:
            raise ValueError(
                f"log2phy must be [E, X] and logcnt [E] for one layer, got "
                f"{tuple(log2phy_EX.shape)} and {tuple(logcnt_E.shape)}"
            )
        if slots_per_rank < 1 or R < 1:
            raise ValueError(f"need slots_per_rank >= 1 and >= 1 rank, got {slots_per_rank}, {R}")
        if int(log2phy_EX.max()) >= R * slots_per_rank or int(log2phy_EX.min()) < -1:
            raise ValueError(
                f"log2phy holds slots outside [0, {R * slots_per_rank}) (or -1 padding) for "
                f"{R} ranks of {slots_per_rank} slots"
            )
        valid_EX = log2phy_EX >= 0
        if not torch.equal(valid_EX.sum(-1), logcnt_E) or int(logcnt_E.min()) < 1:
            raise ValueError("logcnt disagrees with log2phy, or an expert has no replica")
        # valid entries first in each row, so the first max(logcnt) columns hold them all
        if not torch.equal(valid_EX, valid_EX.sort(dim=-1, descending=True, stable=True)[0]):
            raise ValueError("log2phy rows must hold their slots first, then the -1 padding")
        X = int(logcnt_E.max())
        log2phy_EX = log2phy_EX[:, :X].contiguous()
        node_EX = torch.where(
            log2phy_EX >= 0, node_of_rank_R[log2phy_EX.clamp_min(0) // slots_per_rank], -1
        )
        device = device if device is not None else "cpu"
        return cls(log2phy_EX.to(device), node_EX.to(device), node_of_rank_R.to(device))

    @property
    def num_experts(self) -> int:
        return self.log2phy_EX.shape[0]

    @property
    def num_ranks(self) -> int:
        return self.node_of_rank_R.numel()

    def select(
        self,
        topk_ids_TK: torch.Tensor,
        own_rank: int | torch.Tensor,
        offset: int = 0,
        validate: bool = True,
    ) -> torch.Tensor:
        """The physical slot ``[T, K]`` (int64, on the ids' device) serving each choice.

        ``own_rank`` is the rank the tokens start from: an int for a dispatcher's own batch,
        or a ``[T]`` tensor (simulating many ranks at once gives the same answer as one call
        per rank). ``offset`` shifts the start of the round-robin (a step counter, say).
        ``validate=False`` skips the range checks (they read values back from the device).

        Raises ValueError for ids outside ``[0, E)`` or an own rank outside ``[0, R)``."""
        if topk_ids_TK.dim() != 2:
            raise ValueError(f"topk ids must be [tokens, k], got {tuple(topk_ids_TK.shape)}")
        device = topk_ids_TK.device
        ids_TK = topk_ids_TK.long()
        T, K = ids_TK.shape
        E, R = self.num_experts, self.num_ranks
        rank_T = torch.as_tensor(own_rank, dtype=torch.int64, device=device).expand(T)
        if validate and ids_TK.numel():
            lo, hi = int(ids_TK.min()), int(ids_TK.max())
            if lo < 0 or hi >= E:
                raise ValueError(f"expert ids must lie in [0, {E}), got min {lo}, max {hi}")
            if int(rank_T.min()) < 0 or int(rank_T.max()) >= R:
                raise ValueError(f"own rank must lie in [0, {R}), got {own_rank}")
        if ids_TK.numel() == 0:
            return torch.empty_like(ids_TK)
        log2phy_EX = self.log2phy_EX.to(device)
        node_EX = self.node_EX.to(device)
        own_node_T = self.node_of_rank_R.to(device)[rank_T]

        cand_TKX = log2phy_EX[ids_TK]
        local_TKX = node_EX[ids_TK] == own_node_T.view(T, 1, 1)  # padding has node -1
        pool_TKX = torch.where(local_TKX.any(-1, keepdim=True), local_TKX, cand_TKX >= 0)
        pool_size_TK = pool_TKX.sum(-1)

        # number the choices of each (own rank, expert) pair in row-major (t, k) order
        occurrence_TK = _occurrence((rank_T.unsqueeze(1) * E + ids_TK).reshape(-1)).view(T, K)
        pick_TK = (occurrence_TK + rank_T.unsqueeze(1) + offset) % pool_size_TK
        # the pick-th member of the pool: the number of pool columns whose prefix count <= pick
        column_TK = (pool_TKX.cumsum(-1) <= pick_TK.unsqueeze(-1)).sum(-1)
        return cand_TKX.gather(-1, column_TK.unsqueeze(-1)).squeeze(-1)


def select_replicas(
    topk_ids_TK: torch.Tensor,
    log2phy_EX: torch.Tensor,
    logcnt_E: torch.Tensor,
    slots_per_rank: int,
    node_of_rank_R: torch.Tensor,
    own_rank: int | torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:
    """``ReplicaTable.build(log2phy_EX, logcnt_E, slots_per_rank, node_of_rank_R)
    .select(topk_ids_TK, own_rank, offset)``: one call, for tests and simulations; a
    dispatcher keeps the table between steps."""
    table = ReplicaTable.build(
        log2phy_EX, logcnt_E, slots_per_rank, node_of_rank_R, device=topk_ids_TK.device
    )
    return table.select(topk_ids_TK, own_rank, offset)


def _occurrence(key_N: torch.Tensor) -> torch.Tensor:
    """For each entry, how many earlier entries carry the same key."""
    order_N = key_N.argsort(stable=True)
    sorted_N = key_N[order_N]
    new_group_N = torch.ones_like(sorted_N, dtype=torch.bool)
    new_group_N[1:] = sorted_N[1:] != sorted_N[:-1]
    position_N = torch.arange(key_N.numel(), device=key_N.device)
    group_start_N = torch.cummax(torch.where(new_group_N, position_N, 0), 0).values
    out_N = torch.empty_like(key_N)
    out_N[order_N] = position_N - group_start_N
    return out_N
