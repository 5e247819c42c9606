from __future__ import annotations

import os
from pathlib import Path

import pytest

from moeserve.launch import numa
from moeserve.launch.numa import (
    NumaNode,
    RankBinding,
    apply_binding,
    describe,
    format_cpulist,
    parse_cpulist,
    plan_binding,
    read_topology,
)


def make_sysfs(root: Path, nodes: dict[int, str], mem_kb: dict[int, int] | None = None) -> Path:
    """A fake /sys/devices/system/node: nodeN/cpulist and nodeN/meminfo for each node."""
    for node_id, cpulist in nodes.items():
        d = root / f"node{node_id}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
        if mem_kb and node_id in mem_kb:
            (d / "meminfo").write_text(
                f"Node {node_id} MemTotal:       {mem_kb[node_id]} kB\n"
                f"Node {node_id} MemFree:        1000 kB\n"
            )
    # entries sysfs also holds next to the nodes
    (root / "possible").write_text("0-3\n")
    (root / "power").mkdir(exist_ok=True)
    return root


def nodes_of(*sizes: int) -> list[NumaNode]:
    """Nodes with consecutive CPU numbers: nodes_of(8, 6) -> node0 0-7, node1 8-13."""
    out, start = [], 0
    for i, n in enumerate(sizes):
        out.append(NumaNode(i, tuple(range(start, start + n)), None))
        start += n
    return out


def check_plan(bindings: list[RankBinding], topology: list[NumaNode], ranks: int) -> None:
    """Disjoint CPU sets covering every CPU, one binding per rank, threads = CPUs given."""
    assert [b.local_rank for b in bindings] == list(range(ranks))
    given = [c for b in bindings for c in b.cpus]
    assert len(given) == len(set(given)), "CPU sets overlap"
    assert sorted(given) == sorted(c for n in topology for c in n.cpus), "CPUs left out"
    assert all(b.num_threads == len(b.cpus) for b in bindings)


# ---- cpulist ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("0-3,8-11", (0, 1, 2, 3, 8, 9, 10, 11)),
        ("0", (0,)),
        ("5,1,3", (1, 3, 5)),
        ("0-1,1-2", (0, 1, 2)),
        ("", ()),
        ("\n", ()),
        (" 0-2 \n", (0, 1, 2)),
    ],
)
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize(
    "text, message", [("0-", "is not N or N-M"), ("a", "is not N or N-M"), ("3-1", "backwards")]
)
def test_parse_cpulist_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpulist(text)


@pytest.mark.parametrize("text", ["0-3,8-11", "0", "0,2,4", "0-1,3,5-7"])
def test_format_cpulist_round_trip(text):
    assert format_cpulist(parse_cpulist(text)) == text


# ---- dataclasses --------------------------------------------------------------------------------


def test_node_validation():
    with pytest.raises(ValueError, match="cpus must be sorted, distinct"):
        NumaNode(0, (3, 1), None)
    with pytest.raises(ValueError, match="id must be >= 0"):
        NumaNode(-1, (0,), None)
    with pytest.raises(ValueError, match="memory_bytes must be >= 0"):
        NumaNode(0, (0,), -1)


def test_binding_validation():
    with pytest.raises(ValueError, match="local rank 0 has no CPUs"):
        RankBinding(0, 0, (), 1)
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        RankBinding(0, 0, (0,), 0)
    with pytest.raises(ValueError, match="cpus must be sorted, distinct"):
        RankBinding(0, 0, (1, 1), 1)


# ---- reading sysfs ------------------------------------------------------------------------------


def test_read_four_nodes(tmp_path):
    root = make_sysfs(
        tmp_path,
        {i: f"{8 * i}-{8 * i + 7}" for i in range(4)},
        mem_kb={i: 1024 * (i + 1) for i in range(4)},
    )
    topo = read_topology(root, allowed_cpus=range(32))
    assert [n.id for n in topo] == [0, 1, 2, 3]
    assert topo[2].cpus == tuple(range(16, 24))
    assert [n.memory_bytes for n in topo] == [1024 * 1024 * (i + 1) for i in range(4)]


def test_read_orders_nodes_numerically(tmp_path):
    root = make_sysfs(tmp_path, {i: str(i) for i in (0, 2, 10)})
    assert [n.id for n in read_topology(root, allowed_cpus=range(11))] == [0, 2, 10]


def test_read_restricts_to_allowed_cpus(tmp_path):
    root = make_sysfs(tmp_path, {0: "0-7", 1: "8-15"})
    topo = read_topology(root, allowed_cpus={2, 3, 9})
    assert [(n.id, n.cpus) for n in topo] == [(0, (2, 3)), (1, (9,))]
    assert topo[0].memory_bytes is None  # no meminfo written


def test_read_drops_nodes_without_allowed_cpus(tmp_path):
    root = make_sysfs(tmp_path, {0: "0-3", 1: "", 2: "4-7", 3: "8-11"})  # node1: memory only
    topo = read_topology(root, allowed_cpus=range(8))
    assert [n.id for n in topo] == [0, 2]


def test_read_missing_tree_falls_back_to_one_node(tmp_path):
    topo = read_topology(tmp_path / "absent", allowed_cpus=[3, 1, 2])
    assert topo == [NumaNode(0, (1, 2, 3), None)]


def test_read_tree_without_allowed_cpus_falls_back(tmp_path):
    root = make_sysfs(tmp_path, {0: "0-3"})
    assert read_topology(root, allowed_cpus=[8, 9]) == [NumaNode(0, (8, 9), None)]


def test_read_defaults_to_affinity_mask(tmp_path):
    topo = read_topology(tmp_path / "absent")
    assert topo[0].cpus == numa.process_cpus()


def test_read_bad_cpulist_names_file(tmp_path):
    root = make_sysfs(tmp_path, {0: "0-x"})
    with pytest.raises(ValueError, match=r"node0/cpulist: bad CPU list"):
        read_topology(root, allowed_cpus=range(4))


def test_read_no_allowed_cpus(tmp_path):
    with pytest.raises(ValueError, match="no CPUs allowed"):
        read_topology(tmp_path, allowed_cpus=[])


def test_read_real_sysfs():
    topo = read_topology()  # whatever this machine has; never empty
    assert topo and all(n.cpus for n in topo)
    assert {c for n in topo for c in n.cpus} <= set(numa.process_cpus())


# ---- planning -----------------------------------------------------------------------------------


def test_one_rank_per_node(tmp_path):
    root = make_sysfs(tmp_path, {i: f"{8 * i}-{8 * i + 7}" for i in range(4)})
    topo = read_topology(root, allowed_cpus=range(32))
    plan = plan_binding(topo, 4)
    check_plan(plan, topo, 4)
    assert [(b.numa_node, b.cpus) for b in plan] == [(n.id, n.cpus) for n in topo]
    assert [b.num_threads for b in plan] == [8, 8, 8, 8]


def test_several_ranks_per_node():
    topo = nodes_of(8, 8, 8, 8)
    plan = plan_binding(topo, 8)
    check_plan(plan, topo, 8)
    assert [b.numa_node for b in plan] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [b.cpus for b in plan[:2]] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # contiguous halves


def test_ranks_per_node_uneven_split():
    topo = nodes_of(7, 7)
    plan = plan_binding(topo, 4)
    check_plan(plan, topo, 4)
    assert [len(b.cpus) for b in plan] == [4, 3, 4, 3]


def test_split_keeps_hardware_threads_together():
    # Linux numbers each core's second thread in a second range: core c = CPUs c and c + 8
    topo = [NumaNode(0, (*range(0, 4), *range(8, 12))), NumaNode(1, (*range(4, 8), *range(12, 16)))]
    plan = plan_binding(topo, 4)
    check_plan(plan, topo, 4)
    assert [b.cpus for b in plan] == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15)]


def test_fewer_ranks_than_nodes_groups_consecutive_nodes():
    topo = nodes_of(4, 4, 4, 4)
    plan = plan_binding(topo, 2)
    check_plan(plan, topo, 2)
    assert [b.cpus for b in plan] == [tuple(range(0, 8)), tuple(range(8, 16))]
    assert [b.numa_node for b in plan] == [None, None]  # each spans two nodes


def test_fewer_ranks_than_nodes_uneven_groups():
    topo = nodes_of(2, 2, 2, 2, 2)
    plan = plan_binding(topo, 3)
    check_plan(plan, topo, 3)
    assert [len(b.cpus) for b in plan] == [4, 4, 2]
    assert plan[2].numa_node == 4


def test_one_rank_takes_every_node():
    topo = nodes_of(4, 4)
    (b,) = plan_binding(topo, 1)
    assert b.cpus == tuple(range(8)) and b.num_threads == 8


def test_ranks_not_a_multiple_of_nodes():
    topo = nodes_of(8, 8)
    plan = plan_binding(topo, 3)
    check_plan(plan, topo, 3)
    assert [b.numa_node for b in plan] == [0, 0, 1]
    assert [len(b.cpus) for b in plan] == [4, 4, 8]


def test_extra_ranks_go_to_bigger_nodes():
    topo = nodes_of(6, 10)  # two nodes with uneven CPU counts
    plan = plan_binding(topo, 3)
    check_plan(plan, topo, 3)
    assert [b.numa_node for b in plan] == [0, 1, 1]
    assert [len(b.cpus) for b in plan] == [6, 5, 5]


def test_uneven_nodes_one_rank_each():
    topo = nodes_of(6, 10)
    plan = plan_binding(topo, 2)
    check_plan(plan, topo, 2)
    assert [b.num_threads for b in plan] == [6, 10]


def test_nodes_without_cpus_are_ignored():
    topo = [NumaNode(0, (0, 1)), NumaNode(1, ()), NumaNode(2, (2, 3))]
    plan = plan_binding(topo, 2)
    assert [b.numa_node for b in plan] == [0, 2]


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 6, 7, 9, 12, 16, 24, 32])
def test_plans_cover_without_overlap(ranks):
    topo = nodes_of(8, 8, 8, 8)
    check_plan(plan_binding(topo, ranks), topo, ranks)


def test_more_ranks_than_cpus():
    with pytest.raises(ValueError, match="NUMA node 0 has 2 CPUs for 3 ranks .*4 CPUs on 2 nodes"):
        plan_binding(nodes_of(2, 2), 6)
    with pytest.raises(ValueError, match="each of 5 ranks"):
        plan_binding(nodes_of(2, 2), 5)


def test_mode_none():
    topo = nodes_of(8, 8)
    plan = plan_binding(topo, 3, mode="none")
    assert all(b.cpus == tuple(range(16)) and b.numa_node is None for b in plan)
    assert [b.num_threads for b in plan] == [5, 5, 5]
    assert plan_binding(nodes_of(2), 4, mode="none")[0].num_threads == 1


def test_plan_errors():
    with pytest.raises(ValueError, match="unknown NUMA binding mode 'numa'; choose auto \\| none"):
        plan_binding(nodes_of(4), 1, mode="numa")
    with pytest.raises(ValueError, match="local_world_size must be >= 1"):
        plan_binding(nodes_of(4), 0)
    with pytest.raises(ValueError, match="holds no CPUs"):
        plan_binding([NumaNode(0, ())], 1)
    with pytest.raises(ValueError, match="share CPUs"):
        plan_binding([NumaNode(0, (0, 1)), NumaNode(1, (1, 2))], 2)


# ---- applying and describing --------------------------------------------------------------------


def test_apply_binding(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, cpus)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(("threads", n)))
    monkeypatch.setenv("OMP_NUM_THREADS", "99")  # restored after the test
    apply_binding(RankBinding(1, 0, (4, 5, 6), 3))
    assert calls == [(0, (4, 5, 6)), ("threads", 3)]
    assert os.environ["OMP_NUM_THREADS"] == "3"


def test_describe():
    plan = plan_binding(nodes_of(4, 4, 4, 4), 2) + [RankBinding(2, 1, (0, 2, 3), 3)]
    assert describe(plan).splitlines() == [
        "local rank 0: NUMA node -, 8 CPUs 0-7, 8 threads",
        "local rank 1: NUMA node -, 8 CPUs 8-15, 8 threads",
        "local rank 2: NUMA node 1, 3 CPUs 0,2-3, 3 threads",
    ]
