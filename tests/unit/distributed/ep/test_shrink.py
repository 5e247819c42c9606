"""The placement of a layer over the EP ranks that survive a loss (distributed/ep/shrink.py)."""

import pytest
import torch

from moeserve.distributed.ep.placement import ExpertPlacement
from moeserve.distributed.ep.shrink import (
    CannotHoldExperts,
    Reload,
    shrink_placement,
    survivor_placement,
)


def test_the_module_docs_example():
    old = ExpertPlacement.contiguous(8, 4, num_redundant=4)  # [0..7, 0 1 2 3]
    assert old.phys2log_P.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    s = shrink_placement(old, {2})
    # survivors keep their slots; 6 and 7 overwrite the second copies of 1 and 2 on the new
    # rank 2 (old rank 3), the least loaded each time (loads split over copies: 1.5, then 2)
    assert s.placement.ep_size == 3 and s.placement.num_physical == 9
    assert s.placement.phys2log_P.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 3]
    assert s.reloads == (Reload(2, 0, 6), Reload(2, 1, 7))


def test_every_expert_with_a_live_copy_needs_no_reload():
    old = ExpertPlacement.contiguous(4, 4, num_redundant=4)  # [0 1 | 2 3 | 0 1 | 2 3]
    s = shrink_placement(old, {1})
    assert s.reloads == ()
    assert s.placement.phys2log_P.tolist() == [0, 1, 0, 1, 2, 3]


def test_heaviest_missing_expert_goes_to_the_least_loaded_rank():
    # E=6, R=3, S=3: [0 1 2 | 3 4 5 | 0 1 3]; rank 1 dies: 3 survives on rank 2, 4 and 5 lost
    old = ExpertPlacement(torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 3]), 3)
    load = torch.tensor([100.0, 1.0, 1.0, 1.0, 5.0, 50.0])
    s = shrink_placement(old, [1], load)
    # spares: the copies of 0 and 1 (each on ranks 0 and 2). Rank loads: rank 0 = 50 + 0.5
    # + 1, rank 2 = 50 + 0.5 + 1: equal, so rank 0 first, where expert 1 (2 copies, 0.5 per
    # copy) is cheaper to give up than expert 0 (50 per copy)
    assert s.reloads[0] == Reload(0, 1, 5)
    table = s.placement.phys2log_P.tolist()
    assert table[:3] == [0, 5, 2]
    # then expert 4: only expert 0 still has two copies; rank 0 now carries 5's 50
    # (50 + 50 + 1), rank 2 (50 + 1 + 1): the copy of 0 on rank 2 goes
    assert s.reloads[1] == Reload(1, 0, 4)
    assert table == [0, 5, 2, 4, 1, 3]


def test_too_few_slots_is_a_clear_error():
    old = ExpertPlacement.contiguous(8, 4)  # no redundancy: any loss loses experts
    with pytest.raises(CannotHoldExperts, match="too few for the 8 experts"):
        shrink_placement(old, [3])


def test_bad_arguments():
    old = ExpertPlacement.contiguous(8, 4, num_redundant=4)
    with pytest.raises(ValueError, match="outside"):
        shrink_placement(old, [4])
    with pytest.raises(ValueError, match="every EP rank is dead"):
        shrink_placement(old, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="load_E has 3 entries"):
        shrink_placement(old, [1], torch.ones(3))
    with pytest.raises(ValueError, match="unequal slot counts"):
        survivor_placement([[0, 1], [2]], 3)


def test_what_each_rank_holds_is_what_counts():
    # a re-placement cut short: rank 0 already holds its new experts, rank 1 its old ones
    s = survivor_placement([[3, 3, 1], [0, 2, 1]], 4, None, torch.tensor([1.0, 1, 1, 9]))
    assert s.placement.phys2log_P.tolist() == [3, 3, 1, 0, 2, 1]  # all 4 held: no reload
    assert s.reloads == ()


def test_nodes_follow_their_ranks():
    old = ExpertPlacement.contiguous(8, 4, num_redundant=4, node_of_rank=(0, 0, 1, 1))
    s = shrink_placement(old, [1])
    assert s.placement.node_of_rank == (0, 1, 1)


@pytest.mark.parametrize("seed", range(20))
def test_successive_losses_keep_every_expert_while_slots_allow(seed):
    g = torch.Generator().manual_seed(seed)
    E, R, S = 8, 6, 4  # 24 slots for 8 experts
    old = ExpertPlacement(torch.randperm(R * S, generator=g) % E, R)
    load = torch.rand(E, generator=g) * 100
    placement, ranks = old, R
    while ranks > 2:
        dead = int(torch.randint(0, ranks, (1,), generator=g))
        s = shrink_placement(placement, [dead], load)
        table = s.placement.phys2log_P.tolist()
        assert sorted(set(table)) == list(range(E))
        assert len(s.reloads) == len(set(range(E)) - set(_kept(placement, dead)))
        placement, ranks = s.placement, ranks - 1
    with pytest.raises(CannotHoldExperts):
        shrink_placement(placement, [0])  # 4 slots left for 8 experts


def _kept(p: ExpertPlacement, dead: int) -> list[int]:
    S = p.slots_per_rank
    t = p.phys2log_P.tolist()
    return t[: dead * S] + t[(dead + 1) * S :]
