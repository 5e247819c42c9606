"""Which experts a loss leaves without a live copy, under the engine's default placement
``ExpertPlacement.contiguous``: slot ``p`` holds expert ``p % E`` (redundant slot i holds
expert i % E), and rank r holds slots ``[r S, (r+1) S)``::

    E=8, EP 4, 4 redundant (S=3):  [0 1 2 | 3 4 5 | 6 7 0 | 1 2 3]
    rank 1 dies: 4, 5 have no live copy; rank 2: 6, 7; rank 3: none    (mean 4/3, worst 2)

Plain integers in, plain integers out; a failure domain is ``group`` consecutive EP ranks.
"""

from __future__ import annotations

from collections.abc import Collection


def slots_per_rank(num_experts: int, redundant: int, ep: int) -> int:
    if num_experts < 1 or redundant < 0 or ep < 1:
        raise ValueError(
            f"need experts >= 1, redundant >= 0, ep >= 1; got {num_experts}, {redundant}, {ep}"
        )
    if (num_experts + redundant) % ep:
        raise ValueError(
            f"{num_experts} experts + {redundant} redundant slots do not split over EP {ep}: "
            "choose redundant experts so that EP divides the slots"
        )
    return (num_experts + redundant) // ep


def expert_domains(num_experts: int, redundant: int, ep: int, group: int = 1) -> list[set[int]]:
    """For each expert, the failure domains (``group`` consecutive EP ranks) holding a copy."""
    S = slots_per_rank(num_experts, redundant, ep)
    if group < 1 or ep % group:
        raise ValueError(f"a failure domain of {group} ranks does not divide EP {ep}")
    out: list[set[int]] = [set() for _ in range(num_experts)]
    for p in range(num_experts + redundant):
        out[p % num_experts].add(p // S // group)
    return out


def missing_experts(num_experts: int, redundant: int, ep: int, dead: Collection[int]) -> int:
    """Experts with no copy left on a live rank once the EP ranks ``dead`` died."""
    dead = set(dead)
    if any(not 0 <= r < ep for r in dead):
        raise ValueError(f"dead EP ranks {sorted(dead)} lie outside [0, {ep})")
    return sum(1 for d in expert_domains(num_experts, redundant, ep) if d <= dead)


def missing_per_domain(num_experts: int, redundant: int, ep: int, group: int = 1) -> list[int]:
    """Experts left without a live copy when domain i alone dies, for every domain i."""
    counts = [0] * (ep // max(1, group))
    for doms in expert_domains(num_experts, redundant, ep, group):
        if len(doms) == 1:
            counts[next(iter(doms))] += 1
    return counts
