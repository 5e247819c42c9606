"""The expert placement of one MoE layer when replacement ranks join an elastic EP group.

Shape legend: E logical experts, P physical slots, S slots per rank, R ranks (the members
in their order, then the replacements).

The members' slots hold what they held; a replacement's hold nothing yet (``EMPTY_SLOT``).
The new table is EPLB's (:func:`~moeserve.eplb.algorithm.rebalance_experts`) for the layer's
recent load over all R ranks, aligned with what the ranks hold so that little moves:

    1. packs -> ranks   the algorithm's per-rank packs are interchangeable inside a node:
                        each rank takes the pack that shares the most experts with its
                        slots (the largest overlap first; ties by rank, then pack), so a
                        replacement takes a pack no member wanted
    2. slots            inside a rank, an expert the rank already holds keeps its slot; the
                        others fill the remaining slots in ascending order

    held   [0 1 2 | 3 4 5 | - - -]      E=6, S=3, rank 2 joins; expert 0 carries 10x
    EPLB   [0 0 5 | 0 1 3 | 0 2 4]      packs as the algorithm gives them (0 four times)
    new    [0 1 3 | 0 0 5 | 0 2 4]      rank 0 keeps 0 and 1 in their slots, rank 1 keeps
                                        5; rank 2 receives 0, 2 and 4

Then the weights move with the EPLB move machinery (``distributed/ep/migrate.fill_slots``):
a replacement receives every expert of its pack from a member that holds one. Pure and
deterministic, so every rank computes the same table without a message.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from moeserve.distributed.ep.placement import EMPTY_SLOT, ExpertPlacement
from moeserve.eplb.algorithm import rebalance_experts


def node_count(node_of_rank: Sequence[int] | None) -> int:
    """The nodes EPLB's hierarchical form may use for ``node_of_rank``: their number when
    every node holds the same number of ranks, contiguous in rank order; else 1 (global)."""
    if not node_of_rank:
        return 1
    nodes = list(node_of_rank)
    N = len(set(nodes))
    contiguous = nodes == sorted(nodes) and len(nodes) % N == 0
    if not contiguous or any(nodes.count(n) != len(nodes) // N for n in set(nodes)):
        return 1
    return N


def grown_placement(
    held: Sequence[Sequence[int]],
    num_experts: int,
    load_E: torch.Tensor | None = None,
    node_of_rank: Sequence[int] | None = None,
    num_groups: int = 1,
) -> ExpertPlacement:
    """The placement over every rank of the grown group (see the module's doc):
    ``held[r]`` is what rank ``r``'s slots hold, ``EMPTY_SLOT`` where nothing yet;
    ``load_E`` each expert's recent load (None or all zero: equal); ``num_groups`` the
    model's expert groups (hierarchical EPLB when the nodes divide them). Raises ValueError
    for unequal slot counts or too few slots for the experts."""
    R = len(held)
    S = len(held[0]) if held else 0
    if R == 0 or S == 0 or any(len(h) != S for h in held):
        raise ValueError(f"the ranks hold unequal slot counts: {[len(h) for h in held]}")
    load = torch.ones(num_experts, dtype=torch.float64)
    if load_E is not None and float(torch.as_tensor(load_E).sum()) > 0:
        load = torch.as_tensor(load_E, dtype=torch.float64).flatten()
    if load.numel() != num_experts:
        raise ValueError(f"load_E has {load.numel()} entries for {num_experts} experts")
    nodes = node_count(node_of_rank)
    table_P, _, _ = rebalance_experts(load.unsqueeze(0), R * S, num_groups, nodes, R)
    packs = table_P.view(R, S).tolist()
    node = list(node_of_rank) if nodes > 1 else [0] * R
    ordered = [_keep_in_place(held[r], packs[k]) for r, k in enumerate(_match(held, packs, node))]
    nodes_t = None if node_of_rank is None else tuple(int(n) for n in node_of_rank)
    return ExpertPlacement(torch.tensor([e for p in ordered for e in p]), R, nodes_t)


def _match(held: Sequence[Sequence[int]], packs: list[list[int]], node: list[int]) -> list[int]:
    """The pack each rank takes: the pairs of one node by overlap, largest first. Pack ``k``
    lies on the node of rank ``k`` (the algorithm's layout is node-major like the ranks)."""
    R = len(held)
    have = [Counter(e for e in h if e != EMPTY_SLOT) for h in held]
    want = [Counter(p) for p in packs]
    pairs = sorted(
        (-sum((have[r] & want[k]).values()), r, k)
        for r in range(R)
        for k in range(R)
        if node[r] == node[k]
    )
    pack_of: dict[int, int] = {}
    taken: set[int] = set()
    for _, r, k in pairs:
        if r not in pack_of and k not in taken:
            pack_of[r] = k
            taken.add(k)
    return [pack_of[r] for r in range(R)]


def _keep_in_place(held: Sequence[int], pack: list[int]) -> list[int]:
    """``pack``'s experts in slot order: those ``held`` has in a slot stay in it."""
    left = Counter(pack)
    out: list[int | None] = [None] * len(held)
    for j, e in enumerate(held):
        if e != EMPTY_SLOT and left[e] > 0:
            out[j] = e
            left[e] -= 1
    rest = iter(sorted(left.elements()))
    return [e if e is not None else next(rest) for e in out]
