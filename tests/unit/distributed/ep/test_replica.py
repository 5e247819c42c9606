"""select_replicas: valid replicas only, own node first, even spreading, determinism."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.distributed.ep.replica import ReplicaTable, select_replicas
from moeserve.eplb import placement_tables, rebalance_experts

# E=4, P=8 over 4 ranks (S=2) on 2 nodes: expert 0 on every rank, expert 1 on node 1 only
PHY2LOG = torch.tensor([[0, 1, 0, 2, 0, 3, 0, 1]])
NODE_OF_RANK = torch.tensor([0, 0, 1, 1])
LOG2PHY, LOGCNT = (t[0] for t in placement_tables(PHY2LOG, 4))


def choose(ids, own_rank, offset=0):
    ids = torch.as_tensor(ids)
    return select_replicas(ids, LOG2PHY, LOGCNT, 2, NODE_OF_RANK, own_rank, offset)


def test_tables_of_the_example():
    assert LOG2PHY.tolist() == [[0, 2, 4, 6], [1, 7, -1, -1], [3, -1, -1, -1], [5, -1, -1, -1]]


def test_own_node_preferred_and_spread_inside_it():
    ids = torch.zeros(8, 1, dtype=torch.int64)  # 8 choices of expert 0
    for rank in range(4):
        phys = choose(ids, rank).flatten()
        node = int(NODE_OF_RANK[rank])
        assert (NODE_OF_RANK[phys // 2] == node).all()
        local = [0, 2] if node == 0 else [4, 6]
        assert torch.bincount(phys, minlength=8)[local].tolist() == [4, 4]


def test_spread_over_all_when_the_own_node_has_none():
    # expert 1 lives in slots 1 (node 0) and 7 (node 1): from node 0 only slot 1 qualifies
    assert set(choose(torch.ones(6, 1, dtype=torch.int64), 0).flatten().tolist()) == {1}
    assert set(choose(torch.ones(6, 1, dtype=torch.int64), 3).flatten().tolist()) == {7}
    # expert 3 (slot 5, node 1) from node 0: the only replica, remote
    assert set(choose(torch.full((3, 2), 3), 1).flatten().tolist()) == {5}
    # a remote-only expert with two replicas: spread evenly over both
    # (3 ranks of 2 slots, rank 0 alone on node 0; expert 1 in slots 2 and 4, both on node 1)
    l2p, cnt = placement_tables(torch.tensor([[0, 2, 1, 2, 1, 0]]), 3)
    ids = torch.ones(5, 1, dtype=torch.int64)
    phys = select_replicas(ids, l2p[0], cnt[0], 2, torch.tensor([0, 1, 1]), 0)
    assert sorted(torch.bincount(phys.flatten(), minlength=6)[[2, 4]].tolist()) == [2, 3]


def test_ranks_start_at_different_replicas():
    one = torch.zeros(1, 1, dtype=torch.int64)
    assert [int(choose(one, r)) for r in range(4)] == [0, 2, 4, 6]
    assert int(choose(one, 0, offset=1)) == 2


def test_per_token_ranks_equal_one_call_per_rank():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (40, 3), generator=g)
    rank_T = torch.randint(0, 4, (40,), generator=g)
    together = choose(ids, rank_T, offset=5)
    for r in range(4):
        rows = rank_T == r
        assert torch.equal(together[rows], choose(ids[rows], r, offset=5))


def test_no_redundancy_is_a_plain_lookup():
    l2p, cnt = placement_tables(torch.tensor([[3, 1, 0, 2]]), 4)
    ids = torch.tensor([[0, 1], [2, 3]])
    phys = select_replicas(ids, l2p[0], cnt[0], 2, torch.tensor([0, 0]), 1)
    assert phys.tolist() == [[2, 1], [3, 0]]


def test_empty_batch():
    out = choose(torch.empty(0, 2, dtype=torch.int64), 0)
    assert out.shape == (0, 2) and out.dtype == torch.int64


@st.composite
def batches(draw):
    num_nodes = draw(st.integers(1, 3))
    R = num_nodes * draw(st.integers(1, 3))
    E = draw(st.integers(2, 10))
    P = R * (-(-E // R) + draw(st.integers(0, 3)))
    w = torch.tensor(draw(st.lists(st.integers(0, 100), min_size=E, max_size=E)))
    phy2log, log2phy, logcnt = rebalance_experts(w.view(1, E), P, 1, num_nodes, R)
    T, K = draw(st.integers(1, 30)), draw(st.integers(1, min(4, E)))
    ids = torch.tensor(draw(st.lists(st.integers(0, E - 1), min_size=T * K, max_size=T * K)))
    own = draw(st.integers(0, R - 1))
    return ids.view(T, K), phy2log[0], log2phy[0], logcnt[0], P // R, num_nodes, R, own


@settings(max_examples=150, deadline=None)
@given(batches())
def test_properties(batch):
    ids, phy2log, log2phy, logcnt, S, num_nodes, R, own = batch
    node_of_rank = torch.arange(R) // (R // num_nodes)
    phys = select_replicas(ids, log2phy, logcnt, S, node_of_rank, own)
    assert torch.equal(phys, select_replicas(ids, log2phy, logcnt, S, node_of_rank, own))
    assert torch.equal(phy2log[phys], ids)  # only replicas of the routed expert
    own_node = int(node_of_rank[own])
    for e in ids.unique().tolist():
        slots = log2phy[e][: logcnt[e]]
        local = slots[node_of_rank[slots // S] == own_node]
        pool = local if len(local) else slots
        got = phys[ids == e]
        assert torch.isin(got, pool).all()  # own node whenever it holds a replica
        per_slot = torch.bincount(got, minlength=len(phy2log))[pool]
        assert int(per_slot.max() - per_slot.min()) <= 1  # even over the pool


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ids=[[4]]), r"expert ids must lie in \[0, 4\)"),
        (dict(ids=[[-1]]), r"expert ids must lie in \[0, 4\)"),
        (dict(ids=[0, 1]), "tokens, k"),
        (dict(own_rank=4), r"own rank must lie in \[0, 4\)"),
        (dict(logcnt=torch.tensor([4, 2, 1, 2])), "logcnt disagrees"),
        (dict(logcnt=torch.tensor([4, 2, 1])), "one layer"),
        (dict(slots_per_rank=1), "slots outside"),
    ],
)
def test_invalid_arguments(kwargs, match):
    args = dict(ids=[[0, 1]], logcnt=LOGCNT, slots_per_rank=2, own_rank=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        select_replicas(
            torch.tensor(args["ids"]),
            LOG2PHY,
            args["logcnt"],
            args["slots_per_rank"],
            NODE_OF_RANK,
            args["own_rank"],
        )


def test_replica_table_keeps_used_columns_and_matches_one_call():
    # rebalance-style tables carry P - E + 1 columns; the table keeps the most used (4 here)
    wide = torch.cat([LOG2PHY, torch.full((4, 3), -1)], dim=1)
    table = ReplicaTable.build(wide, LOGCNT, 2, NODE_OF_RANK)
    assert table.log2phy_EX.shape == (4, 4)
    assert table.node_EX.tolist() == [
        [0, 0, 1, 1],
        [0, 1, -1, -1],
        [0, -1, -1, -1],
        [1, -1, -1, -1],
    ]
    ids = torch.randint(0, 4, (16, 2), generator=torch.Generator().manual_seed(1))
    for rank in range(4):
        assert torch.equal(table.select(ids, rank, 3), choose(ids, rank, offset=3))
        assert torch.equal(table.select(ids, rank, 3, validate=False), table.select(ids, rank, 3))


def test_replica_table_rejects_padding_before_slots():
    with pytest.raises(ValueError, match="slots first"):
        ReplicaTable.build(
            torch.tensor([[-1, 0], [1, -1]]), torch.tensor([1, 1]), 1, torch.zeros(2)
        )
