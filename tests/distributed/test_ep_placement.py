"""ExpertPlacement: the slot table, its derived EPLB-style views, and its validation."""

from __future__ import annotations

import pytest
import torch

from moeserve.distributed.ep import ExpertPlacement


def test_contiguous_without_redundancy():
    p = ExpertPlacement.contiguous(8, 4)
    assert p.phys2log_P.tolist() == list(range(8))
    assert (p.num_logical, p.num_physical, p.slots_per_rank) == (8, 8, 2)
    assert p.local_logical(0) == [0, 1] and p.local_logical(3) == [6, 7]
    assert p.log2phys.tolist() == [[e] for e in range(8)]
    assert p.logcnt.tolist() == [1] * 8


def test_contiguous_with_redundancy():
    p = ExpertPlacement.contiguous(8, 3, num_redundant=4)
    assert p.phys2log_P.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert p.slots_per_rank == 4
    assert p.local_logical(2) == [0, 1, 2, 3]
    assert p.logcnt.tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    assert p.log2phys.tolist() == [
        [0, 8],
        [1, 9],
        [2, 10],
        [3, 11],
        [4, -1],
        [5, -1],
        [6, -1],
        [7, -1],
    ]


def test_log2phys_inverts_phys2log():
    g = torch.Generator().manual_seed(0)
    table = torch.cat([torch.arange(16), torch.randint(0, 16, (8,), generator=g)])
    p = ExpertPlacement(table[torch.randperm(24, generator=g)], ep_size=4)
    for e in range(16):
        slots = p.log2phys[e][: p.logcnt[e]]
        assert (p.log2phys[e][p.logcnt[e] :] == -1).all()
        assert (p.phys2log_P[slots] == e).all()
        assert slots.tolist() == sorted(slots.tolist())
    assert int(p.logcnt.sum()) == 24


def test_physical_ids_hits_a_replica_and_spreads_evenly():
    p = ExpertPlacement.contiguous(4, 2, num_redundant=4)  # every expert twice: e and 4 + e
    ids_TK = torch.zeros(6, 2, dtype=torch.int64)  # 12 choices, all of expert 0
    phys_TK = p.physical_ids(ids_TK)
    assert (p.phys2log_P[phys_TK] == 0).all()
    assert torch.bincount(phys_TK.flatten()).tolist() == [6, 0, 0, 0, 6]
    assert torch.equal(phys_TK, p.physical_ids(ids_TK))  # deterministic
    assert (p.physical_ids(ids_TK[:1, :1], offset=1) == 4).all()


def test_physical_ids_identity_without_redundancy_and_empty():
    p = ExpertPlacement.contiguous(8, 2)
    ids = torch.randint(0, 8, (5, 3))
    assert torch.equal(p.physical_ids(ids), ids)
    assert p.physical_ids(torch.empty(0, 3, dtype=torch.int64)).shape == (0, 3)


@pytest.mark.parametrize(
    "table, ep_size, match",
    [
        ([0, 1, 2], 2, "do not split evenly"),
        ([0, 1, -1, 2], 2, "negative"),
        ([0, 1, 3, 3], 2, r"experts \[2\] have no physical slot"),
        ([0, 1], 0, "ep_size must be"),
    ],
)
def test_invalid_tables(table, ep_size, match):
    with pytest.raises(ValueError, match=match):
        ExpertPlacement(torch.tensor(table), ep_size)


def test_invalid_contiguous_and_lookups():
    with pytest.raises(ValueError, match="does not divide"):
        ExpertPlacement.contiguous(8, 3)
    p = ExpertPlacement.contiguous(8, 2)
    with pytest.raises(ValueError, match=r"in \[0, 8\)"):
        p.physical_ids(torch.tensor([[8]]))
    with pytest.raises(ValueError, match="outside"):
        p.local_logical(2)


def test_table_is_a_private_int64_copy():
    src = torch.tensor([0, 1], dtype=torch.int32)
    p = ExpertPlacement(src, 1)
    src[0] = 1
    assert p.phys2log_P.dtype == torch.int64 and p.phys2log_P.tolist() == [0, 1]
