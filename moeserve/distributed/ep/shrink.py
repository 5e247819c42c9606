"""The expert placement of one MoE layer after EP ranks died (elastic EP).

Shape legend: E logical experts, P physical slots, S slots per rank, R ranks.

The survivors keep every slot they hold (their weights are already in memory); the dead
ranks' slots are gone. Survivor ``live[i]`` becomes EP rank ``i``, so the new table is the
survivors' slots back to back, ``R' * S`` slots::

    old  [0 1 2 | 3 4 5 | 6 7 0 | 1 2 3]    E=8, R=4, S=3; rank 2 dies
    kept [0 1 2 | 3 4 5 | 1 2 3]            experts 6 and 7 have no live copy
    new  [0 1 2 | 3 4 5 | 6 7 3]            6 and 7 overwrite second copies (of 1 and 2),
                                            each on the rank with the least load then

An expert with no live copy (:attr:`Shrink.reloads`) is read again from the checkpoint into
a slot that held a second copy of another expert: on the rank with the least expected load
(``load_E`` split evenly over each expert's copies), taking there the slot whose expert has
the most copies (then the lightest per copy, then the lowest slot). The missing experts are
placed heaviest first. Pure and deterministic, so every survivor computes the same table
without a message. When no slot holds a second copy of anything while an expert is still
missing, the survivors cannot hold every expert: :class:`CannotHoldExperts`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from moeserve.distributed.ep.placement import ExpertPlacement


class CannotHoldExperts(ValueError):
    """The live ranks' slots are fewer than the experts they must serve."""


@dataclass(frozen=True)
class Reload:
    """Expert ``expert`` is read from the checkpoint into local slot ``slot`` of new EP rank
    ``rank``."""

    rank: int
    slot: int
    expert: int


@dataclass(frozen=True)
class Shrink:
    """One layer's placement over the live ranks and the experts to read again."""

    placement: ExpertPlacement
    reloads: tuple[Reload, ...]


def shrink_placement(
    old: ExpertPlacement, dead: Collection[int], load_E: torch.Tensor | None = None
) -> Shrink:
    """The placement of ``old`` without the EP ranks in ``dead``: :func:`survivor_placement`
    of the slots the live ranks hold by ``old``. Raises ValueError for a dead rank outside
    ``[0, ep_size)`` or every rank dead."""
    R, S = old.ep_size, old.slots_per_rank
    dead = set(dead)
    if any(not 0 <= r < R for r in dead):
        raise ValueError(f"dead EP ranks {sorted(dead)} lie outside [0, {R})")
    live = tuple(r for r in range(R) if r not in dead)
    old_P = old.phys2log_P.tolist()
    held = [old_P[r * S : (r + 1) * S] for r in live]
    nodes = None if old.node_of_rank is None else [old.node_of_rank[r] for r in live]
    return survivor_placement(held, old.num_logical, nodes, load_E)


def survivor_placement(
    held: Sequence[Sequence[int]],
    num_experts: int,
    node_of_rank: Sequence[int] | None = None,
    load_E: torch.Tensor | None = None,
) -> Shrink:
    """The placement over the live ranks, ``held[i]`` being the experts in the slots of new
    EP rank ``i`` (see the module's doc). Each rank reports what its own slots hold, so a
    re-placement that the loss cut short on some ranks and not others is read as it is.

    ``load_E``: each logical expert's recent load (tokens routed to it; None: equal). Raises
    ValueError when no rank is left or the ranks hold unequal slot counts, and
    CannotHoldExperts when their slots cannot hold all ``num_experts`` experts."""
    if not held:
        raise ValueError("every EP rank is dead: nothing is left to serve")
    S, E = len(held[0]), num_experts
    if S == 0 or any(len(h) != S for h in held):
        raise ValueError(f"the live ranks hold unequal slot counts: {[len(h) for h in held]}")
    table = [int(e) for h in held for e in h]
    load = [1.0] * E if load_E is None else [float(x) for x in torch.as_tensor(load_E).tolist()]
    if len(load) != E:
        raise ValueError(f"load_E has {len(load)} entries for {E} experts")
    count = [0] * E
    for e in table:
        count[e] += 1
    missing = sorted((e for e in range(E) if count[e] == 0), key=lambda e: (-load[e], e))
    reloads = []
    for e in missing:
        spare = [p for p, x in enumerate(table) if count[x] >= 2]
        if not spare:
            raise CannotHoldExperts(
                f"the {len(held)} live EP ranks hold {len(table)} expert slots, too few for "
                f"the {E} experts: {len(missing) - len(reloads)} expert(s) have no live copy "
                "and no slot holds a second copy to give up (more --ep-num-redundant-experts "
                "would let the service survive this loss)"
            )

        def rank_load(r: int) -> float:
            return sum(load[x] / count[x] for x in table[r * S : (r + 1) * S])

        def slot_key(p: int) -> tuple:
            x = table[p]
            return (rank_load(p // S), -count[x], load[x] / count[x], p)

        p = min(spare, key=slot_key)
        count[table[p]] -= 1
        table[p] = e
        count[e] = 1
        reloads.append(Reload(p // S, p % S, e))
    nodes = None if node_of_rank is None else tuple(int(n) for n in node_of_rank)
    placement = ExpertPlacement(torch.tensor(table), len(held), nodes)
    return Shrink(placement, tuple(reloads))
