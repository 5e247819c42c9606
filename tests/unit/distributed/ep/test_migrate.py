"""Moving experts between ranks (``distributed/ep/migrate.py``): the transfer plan, simulated
for every rank in one process, lands each new slot's expert (also into a replacement's empty
slots); replica choice with nodes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moeserve.distributed.ep import ExpertPlacement
from moeserve.distributed.ep.migrate import (
    _pack,
    _unpack_into,
    slot_tensors,
    table_plan,
    transfer_plan,
)
from moeserve.distributed.ep.placement import EMPTY_SLOT
from moeserve.quant.int4 import Int4Tensor
from moeserve.quant.int8 import Int8Tensor


def fake_experts(table: list[int], quant: str | bool = False) -> SimpleNamespace:
    """Slot s holds the weights of expert table[s]: every value derived from the expert id.
    ``quant``: w13 as an int8 weight (True or "int8": values and scales) or an int4 one
    (packed codes, scales, zero points and an act-order column order), else dense."""
    ids = torch.tensor(table, dtype=torch.float32)
    w13 = ids.view(-1, 1, 1) * 10 + torch.arange(12.0).view(1, 4, 3)
    w2 = ids.view(-1, 1, 1) * 10 + torch.arange(6.0).view(1, 3, 2)
    if quant in (True, "int8"):
        q = Int8Tensor(w13.to(torch.int8), w13[:, :, 0].clone())
        return SimpleNamespace(w13_EFD=q, w2_EDF=w2)
    if quant == "int4":
        codes = (ids.view(-1, 1, 1) * 7 + torch.arange(64.0).view(1, 1, 64)).expand(-1, 4, -1)
        q = Int4Tensor(
            codes.remainder(256).to(torch.uint8).contiguous(),
            codes[:, :, :2].clone(),  # fp32 scales [S, 4, 2]: K = 128, groups of 64
            codes[:, :, :2].remainder(16).to(torch.uint8).contiguous(),
            perm=(ids.view(-1, 1) + torch.arange(128.0)).to(torch.int32),
        )
        return SimpleNamespace(w13_EFD=q, w2_EDF=w2)
    return SimpleNamespace(w13_EFD=w13.transpose(1, 2).contiguous().transpose(1, 2), w2_EDF=w2)


def simulate(old: ExpertPlacement, new: ExpertPlacement, int8: str | bool = False):
    """Run every rank's plan; the all_to_all is a loop over (source, destination)."""
    R, S = old.ep_size, old.slots_per_rank
    ranks = [fake_experts(old.local_logical(r), int8) for r in range(R)]
    plans = [transfer_plan(old, new, r) for r in range(R)]
    run_plans(ranks, plans, new, int8)
    return plans, S


def run_plans(ranks, plans, new: ExpertPlacement, int8: str | bool = False) -> None:
    """Carry out ``plans`` on every rank's slots, then check each holds ``new``'s experts."""
    R = len(ranks)
    sent = [
        [_pack(slot_tensors(ranks[r]), list(plans[r].send[d])) for d in range(R)] for r in range(R)
    ]
    for r in range(R):
        tensors = slot_tensors(ranks[r])
        local = _pack(tensors, [o for _, o in plans[r].local])
        for i, (j, _) in enumerate(plans[r].local):
            _unpack_into(local[i], tensors, j)
        for j, src, e in plans[r].recv:
            row = plans[r].recv_order[src].index(e)
            assert len(plans[r].recv_order[src]) == sent[src][r].shape[0]
            _unpack_into(sent[src][r][row], tensors, j)
    expected = [fake_experts(new.local_logical(r), int8) for r in range(R)]
    for got, want in zip(ranks, expected):
        for a, b in zip(slot_tensors(got), slot_tensors(want)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("int8", [False, "int8", "int4"])
@pytest.mark.parametrize("R, E, redundant", [(2, 8, 0), (4, 16, 4), (3, 6, 3)])
def test_plan_lands_every_new_slot(R, E, redundant, int8):
    g = torch.Generator().manual_seed(R * 100 + E)
    old = ExpertPlacement.contiguous(E, R, redundant)
    for _ in range(5):
        extra = torch.randint(0, E, (redundant,), generator=g)
        table = torch.cat([torch.arange(E), extra])[torch.randperm(E + redundant, generator=g)]
        new = old.with_table(table)
        simulate(old, new, int8)
        old = new


def test_unchanged_slots_do_not_move_and_copies_are_local_first():
    old = ExpertPlacement(torch.tensor([0, 1, 2, 3, 0, 1]), 2)  # rank 0: 0 1 2, rank 1: 3 0 1
    new = old.with_table(torch.tensor([0, 0, 2, 3, 1, 1]))
    plans, _ = simulate(old, new)
    assert plans[0].local == ((1, 0),) and plans[0].recv == ()  # 0 copied from its own slot 0
    assert plans[1].local == ((1, 2),) and plans[1].recv == ()
    assert transfer_plan(old, old, 0).num_changed == 0


def test_remote_fetches_spread_over_owners():
    # expert 0 on ranks 0 and 1; ranks 2 and 3 both want it: they ask different owners
    old = ExpertPlacement(torch.tensor([0, 1, 0, 2, 3, 4, 5, 6]), 4)
    new = old.with_table(torch.tensor([1, 2, 3, 4, 0, 5, 0, 6]))
    plans, _ = simulate(old, new)
    sources = {plans[r].recv[0][1] for r in (2, 3) if plans[r].recv}
    assert sources == {0, 1}


def test_plan_refuses_other_sizes():
    with pytest.raises(ValueError, match="keeps both"):
        transfer_plan(ExpertPlacement.contiguous(8, 2), ExpertPlacement.contiguous(8, 4), 0)


def test_physical_ids_prefer_own_node_then_spread():
    # 4 ranks on 2 nodes, 8 experts + 4 redundant copies of 0..3 (slots 8..11 on rank 3)
    p = ExpertPlacement.contiguous(8, 4, num_redundant=4, node_of_rank=(0, 0, 1, 1))
    ids = torch.zeros(4, 1, dtype=torch.int64)  # expert 0: slot 0 (node 0), slot 8 (node 1)
    assert p.physical_ids(ids, own_rank=0).flatten().tolist() == [0, 0, 0, 0]
    assert p.physical_ids(ids, own_rank=2).flatten().tolist() == [8, 8, 8, 8]
    flat = ExpertPlacement.contiguous(8, 4, num_redundant=4)  # one node: round-robin
    assert sorted(flat.physical_ids(ids, own_rank=2).flatten().tolist()) == [0, 0, 8, 8]
    assert torch.equal(p.physical_ids(ids, own_rank=1), p.physical_ids(ids, own_rank=1))
    with pytest.raises(ValueError, match="node_of_rank"):
        ExpertPlacement.contiguous(8, 4, node_of_rank=(0, 1))


def test_empty_slots_fill_from_the_members():
    """A replacement's empty slots (elastic EP) receive every expert from a member; it sends
    nothing, and an expert with no copy anywhere is refused."""
    R, S = 3, 3
    old_P = [0, 1, 2, 3, 4, 5, EMPTY_SLOT, EMPTY_SLOT, EMPTY_SLOT]
    new = ExpertPlacement(torch.tensor([0, 1, 3, 0, 0, 5, 0, 2, 4]), R)
    ranks = [fake_experts([max(e, 0) for e in old_P[r * S : (r + 1) * S]]) for r in range(R)]
    plans = [table_plan(old_P, new, r) for r in range(R)]
    assert plans[2].local == () and all(s == () for s in plans[2].send)
    assert sorted(e for _, _, e in plans[2].recv) == [0, 2, 4]
    run_plans(ranks, plans, new)
    with pytest.raises(ValueError, match=r"experts \[5\] have no copy"):
        table_plan([0, 1, 2, 3, 4, EMPTY_SLOT], ExpertPlacement(torch.arange(6), 2), 0)
    with pytest.raises(ValueError, match="old table of 4 slots"):
        table_plan([0, 1, 2, 3], new, 0)
