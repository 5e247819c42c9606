"""The placement as replacement ranks join an elastic EP group (``eplb/grow.py``): EPLB's
balance over every rank, aligned with what the members hold so that little moves."""

from __future__ import annotations

import pytest
import torch

from moeserve.distributed.ep.placement import EMPTY_SLOT
from moeserve.eplb.algorithm import imbalance, rank_load, rebalance_experts
from moeserve.eplb.grow import grown_placement, node_count

_ = EMPTY_SLOT


def test_the_documented_example():
    load = torch.tensor([10.0, 1, 1, 1, 1, 1])
    p = grown_placement([[0, 1, 2], [3, 4, 5], [_, _, _]], 6, load)
    assert p.phys2log_P.tolist() == [0, 1, 3, 0, 0, 5, 0, 2, 4]


@pytest.mark.parametrize("R, E, S, joining", [(4, 16, 6, 1), (4, 16, 8, 2), (8, 32, 6, 2)])
def test_balanced_as_eplb_and_members_keep_most(R, E, S, joining):
    g = torch.Generator().manual_seed(R * E + S)
    load = torch.rand(E, generator=g) ** 4 * 100  # skewed, as real routing is
    members = R - joining
    # the members hold a survivor placement: every expert, the rest second copies
    table = torch.cat(
        [torch.randperm(E, generator=g), torch.randint(0, E, (members * S - E,), generator=g)]
    )
    held = [table[r * S : (r + 1) * S].tolist() for r in range(members)] + [[_] * S] * joining
    p = grown_placement(held, E, load)
    assert (
        p.ep_size == R
        and p.slots_per_rank == S
        and sorted(set(p.phys2log_P.tolist())) == list(range(E))
    )
    eplb = rebalance_experts(load.unsqueeze(0), R * S, 1, 1, R)[0]
    # the same load per rank as EPLB's packs: the alignment only reorders them
    mine = imbalance(rank_load(load.unsqueeze(0), p.phys2log_P.unsqueeze(0), R))
    theirs = imbalance(rank_load(load.unsqueeze(0), eplb, R))
    assert torch.allclose(mine, theirs)
    # a slot keeps its expert whenever the rank's pack has it
    kept = sum(p.local_logical(r)[j] == held[r][j] for r in range(members) for j in range(S))
    raw = sum(eplb[0, r * S + j] == held[r][j] for r in range(members) for j in range(S))
    assert kept >= raw and kept > 0
    for r in range(members, R):  # a replacement takes a full share
        assert EMPTY_SLOT not in p.local_logical(r)


def test_nodes_keep_expert_groups_together():
    load = torch.ones(16)
    load[:4] = 50.0
    # 24 slots over 2 nodes; the members hold every expert, rank 3 (node 1) joins
    held = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 0, 1], [_] * 6]
    p = grown_placement(held, 16, load, node_of_rank=(0, 0, 1, 1), num_groups=4)
    assert p.node_of_rank == (0, 0, 1, 1)
    table = p.phys2log_P.tolist()
    for grp in range(4):  # each group of 4 experts lies on one node (12 slots per node)
        assert len({s // 12 for s, e in enumerate(table) if e // 4 == grp}) == 1


def test_zero_load_and_bad_input():
    p = grown_placement([[0, 1], [2, 3], [_, _]], 4, torch.zeros(4))
    assert sorted(set(p.phys2log_P.tolist())) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="unequal slot counts"):
        grown_placement([[0, 1], [2]], 3)
    with pytest.raises(ValueError, match="load_E has 3 entries"):
        grown_placement([[0, 1], [2, 3]], 4, torch.ones(3))
    with pytest.raises(ValueError, match="below the 5 logical experts"):
        grown_placement([[0, 1], [2, 3]], 5)
    assert node_count(None) == 1 and node_count((0, 0, 1, 1)) == 2
    assert node_count((0, 1, 0, 1)) == 1 and node_count((0, 0, 0, 1)) == 1
