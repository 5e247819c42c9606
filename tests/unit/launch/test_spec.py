from __future__ import annotations

import socket

import pytest

from moeserve.launch.spec import (
    LaunchSpec,
    check_world_size,
    detect_external,
    expand_nodelist,
    expand_tasks_per_node,
    free_port,
    plan_local_ranks,
)


def spec(**overrides) -> LaunchSpec:
    fields = dict(
        world_size=8,
        rank=5,
        local_rank=1,
        local_world_size=4,
        nnodes=2,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29500,
        source="torchrun",
    )
    fields.update(overrides)
    return LaunchSpec(**fields)


# ---- LaunchSpec ---------------------------------------------------------------------------------


def test_spec_properties():
    s = spec()
    assert s.init_method == "tcp://10.0.0.1:29500"
    assert not s.is_driver
    assert spec(rank=0, local_rank=0, node_rank=0).is_driver


@pytest.mark.parametrize(
    "addr, url",
    [
        ("fe80::1", "tcp://[fe80::1]:29500"),
        ("[::1]", "tcp://[::1]:29500"),
        ("node01", "tcp://node01:29500"),
    ],
)
def test_init_method_brackets_ipv6(addr, url):
    assert spec(master_addr=addr).init_method == url


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(world_size=0), "world_size must be >= 1"),
        (dict(rank=8), r"rank must be in \[0, 8\)"),
        (dict(rank=-1), r"rank must be in \[0, 8\)"),
        (dict(local_world_size=9), "local_world_size must be in"),
        (dict(local_rank=4), r"local_rank must be in \[0, 4\)"),
        (dict(nnodes=0), "nnodes must be in"),
        (dict(node_rank=2), r"node_rank must be in \[0, 2\)"),
        (dict(master_port=0), "master_port must be in"),
        (dict(master_port=70000), "master_port must be in"),
        (dict(master_addr=" "), "master_addr is empty"),
        (dict(source="mpirun"), "unknown launch source 'mpirun'; choose spawn | torchrun"),
        (dict(source="spawn"), "a spawned world lives on one host"),
    ],
)
def test_spec_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        spec(**overrides)


def test_spec_is_frozen():
    with pytest.raises(AttributeError):
        spec().rank = 0  # type: ignore[misc]


# ---- Slurm node lists ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("  node1  ", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("node[001-002]", ["node001", "node002"]),
        ("node[5]", ["node5"]),
        ("node[1,3,5]", ["node1", "node3", "node5"]),
        (
            "node[01-03,07],gpu5,x[1-2]-ib",
            ["node01", "node02", "node03", "node07", "gpu5", "x1-ib", "x2-ib"],
        ),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("rack[1-2]-node[09-10]", ["rack1-node09", "rack1-node10", "rack2-node09", "rack2-node10"]),
        ("[1-2]x", ["1x", "2x"]),
        ("cn-a[1-2],cn-b3", ["cn-a1", "cn-a2", "cn-b3"]),
        ("host.example.com", ["host.example.com"]),
        ("node[1, 3]", ["node1", "node3"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist, message",
    [
        ("", "empty node list"),
        ("   ", "empty node list"),
        ("a,,b", "empty host name"),
        ("a,", "empty host name"),
        ("node[1-3", "unclosed '\\['"),
        ("node1-3]", "unmatched '\\]'"),
        ("node[1-[2]]", "nested '\\['"),
        ("node[3-1]", "runs backwards"),
        ("node[a-c]", "bad range 'a-c'"),
        ("node[]", "bad range ''"),
        ("node[1-]", "bad range '1-'"),
        ("node[1,,2]", "bad range ''"),
    ],
)
def test_expand_nodelist_errors(nodelist, message):
    with pytest.raises(ValueError, match=message):
        expand_nodelist(nodelist)


@pytest.mark.parametrize(
    "text, counts",
    [("4", [4]), ("4(x2),3", [4, 4, 3]), ("2(x3)", [2, 2, 2]), ("1,2,1(x2)", [1, 2, 1, 1])],
)
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "4(2)", "x", "0", "4(x0)", "4,,3"])
def test_expand_tasks_per_node_errors(text):
    with pytest.raises(ValueError, match="bad task count"):
        expand_tasks_per_node(text)


# ---- torchrun -----------------------------------------------------------------------------------

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}

SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "11",
    "SLURM_LOCALID": "2",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NODELIST": "cn[07-09]",
    "SLURM_JOB_NODELIST": "cn[01-09]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2),3",
    "SLURM_TASKS_PER_NODE": "4(x9)",
    "SLURM_JOB_ID": "123456",
}


def test_no_launcher():
    assert detect_external({}) is None
    assert detect_external({"PATH": "/bin", "RANK": "0"}) is None  # WORLD_SIZE missing


def test_torchrun():
    s = detect_external(TORCHRUN)
    assert s == spec()
    assert s.init_method == "tcp://10.0.0.1:29500"


def test_torchrun_without_group_vars():
    env = {k: v for k, v in TORCHRUN.items() if not k.startswith("GROUP_")}
    s = detect_external(env)
    assert (s.nnodes, s.node_rank) == (2, 1)


def test_torchrun_wins_over_slurm():
    s = detect_external({**SLURM, **TORCHRUN})
    assert s.source == "torchrun"
    assert s.rank == 5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"LOCAL_RANK": None}, "LOCAL_RANK is not set \\(torchrun sets it"),
        ({"LOCAL_WORLD_SIZE": None}, "LOCAL_WORLD_SIZE is not set"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
        ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
        ({"RANK": "five"}, "RANK='five' is not an integer"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
        ({"RANK": "-1"}, "RANK=-1 must be >= 0"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a TCP port"),
        ({"RANK": "8"}, "inconsistent torchrun environment: rank must be in"),
        ({"GROUP_WORLD_SIZE": None, "WORLD_SIZE": "7", "RANK": "1"}, "set GROUP_WORLD_SIZE"),
    ],
)
def test_torchrun_errors(change, message):
    env = {**TORCHRUN, **change}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        detect_external(env)


# ---- Slurm --------------------------------------------------------------------------------------


def test_slurm():
    s = detect_external(SLURM)
    assert s == LaunchSpec(
        world_size=11,
        rank=6,
        local_rank=2,
        local_world_size=4,
        nnodes=3,
        node_rank=1,
        master_addr="cn07",  # first host of the step, not of the job
        master_port=20000 + 123456 % 20000,
        source="slurm",
    )


def test_slurm_last_node_has_fewer_tasks():
    s = detect_external({**SLURM, "SLURM_PROCID": "10", "SLURM_NODEID": "2"})
    assert s.local_world_size == 3


def test_slurm_job_level_fallbacks():
    env = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP_")}
    env["SLURM_JOB_NODELIST"] = "big[3-5]"
    env["SLURM_TASKS_PER_NODE"] = "4(x2),3"
    s = detect_external(env)
    assert s.master_addr == "big3"
    assert s.local_world_size == 4


def test_slurm_nnodes_defaults_to_task_counts():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NNODES"}
    assert detect_external(env).nnodes == 3


def test_slurm_master_overrides():
    s = detect_external({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (s.master_addr, s.master_port) == ("head", 1234)


def test_slurm_port_agrees_across_tasks():
    ports = {
        detect_external({**SLURM, "SLURM_PROCID": str(r), "SLURM_LOCALID": "0"}).master_port
        for r in (0, 4, 8)
    }
    assert len(ports) == 1
    assert 20000 <= ports.pop() < 40000


@pytest.mark.parametrize(
    "change, message",
    [
        ({"SLURM_LOCALID": None}, "SLURM_LOCALID is not set \\(srun sets it"),
        ({"SLURM_NODEID": None}, "SLURM_NODEID is not set"),
        (
            {"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": None},
            "SLURM_STEP_TASKS_PER_NODE is not set",
        ),
        ({"SLURM_STEP_TASKS_PER_NODE": "4(2)"}, "SLURM_STEP_TASKS_PER_NODE: bad task count"),
        ({"SLURM_NNODES": "2"}, "lists 3 nodes but SLURM_NNODES=2"),
        ({"SLURM_STEP_TASKS_PER_NODE": "4(x3),3"}, "lists 4 nodes but SLURM_NNODES=3"),
        ({"SLURM_STEP_TASKS_PER_NODE": "4,4,4"}, "adds up to 12 tasks but SLURM_NTASKS=11"),
        ({"SLURM_NODEID": "3"}, "SLURM_NODEID=3 is outside the step's 3 nodes"),
        ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, "SLURM_STEP_NODELIST is"),
        ({"SLURM_STEP_NODELIST": "cn[07-"}, "SLURM_STEP_NODELIST: unclosed"),
        ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set .*or set MASTER_PORT"),
        ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc' is not an integer"),
        ({"SLURM_NTASKS": "x"}, "SLURM_NTASKS='x' is not an integer"),
        ({"SLURM_LOCALID": "4"}, "inconsistent slurm environment: local_rank must be in"),
        ({"SLURM_PROCID": "11"}, "inconsistent slurm environment: rank must be in"),
    ],
)
def test_slurm_errors(change, message):
    env = {**SLURM, **change}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        detect_external(env)


def test_slurm_needs_ntasks():
    # an sbatch script without --ntasks sets SLURM_PROCID alone: no external launcher
    assert detect_external({"SLURM_PROCID": "0", "SLURM_JOB_ID": "1"}) is None


# ---- ranks moeserve spawns ----------------------------------------------------------------------


def test_free_port_is_bindable():
    port = free_port()
    assert 1 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_plan_one_host():
    specs = plan_local_ranks(4)
    assert [s.rank for s in specs] == [0, 1, 2, 3]
    assert [s.local_rank for s in specs] == [0, 1, 2, 3]
    assert {(s.world_size, s.local_world_size, s.nnodes, s.node_rank) for s in specs} == {
        (4, 4, 1, 0)
    }
    assert {s.source for s in specs} == {"spawn"}
    assert len({s.master_port for s in specs}) == 1
    assert specs[0].is_driver and not specs[1].is_driver


def test_plan_one_host_given_port():
    specs = plan_local_ranks(2, master_port=31000)
    assert {s.init_method for s in specs} == {"tcp://127.0.0.1:31000"}


@pytest.mark.parametrize("node_rank, ranks", [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])])
def test_plan_two_hosts(node_rank, ranks):
    specs = plan_local_ranks(
        8, nnodes=2, node_rank=node_rank, master_addr="10.0.0.1", master_port=29500
    )
    assert [s.rank for s in specs] == ranks
    assert [s.local_rank for s in specs] == [0, 1, 2, 3]
    assert all(s.local_world_size == 4 and s.nnodes == 2 for s in specs)
    assert all(s.node_rank == node_rank and s.source == "flags" for s in specs)
    assert {s.init_method for s in specs} == {"tcp://10.0.0.1:29500"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=6, nnodes=4, master_port=1), "world size 6 does not divide evenly"),
        (dict(world_size=8, nnodes=2), "--master-port is required with --nnodes 2"),
        (dict(world_size=8, nnodes=2, node_rank=2, master_port=1), "--node-rank must be in"),
        (dict(world_size=8, nnodes=0), "--nnodes must be >= 1"),
        (dict(world_size=0), "world size must be >= 1"),
    ],
)
def test_plan_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_local_ranks(**kwargs)


# ---- world size against the layout --------------------------------------------------------------


def test_check_world_size_passes():
    check_world_size(spec(), 8, "--tp 2 --dp 4 --pp 1")


def test_check_world_size_torchrun():
    s = spec(world_size=4, rank=1, local_rank=1, local_world_size=4, nnodes=1, node_rank=0)
    with pytest.raises(
        ValueError, match="torchrun started 4 ranks but --tp 2 --dp 4 --pp 1 needs 8"
    ):
        check_world_size(s, 8, "--tp 2 --dp 4 --pp 1")


def test_check_world_size_slurm():
    s = detect_external(SLURM)
    with pytest.raises(
        ValueError, match="srun started 11 ranks .* needs 8; run srun with --ntasks 8"
    ):
        check_world_size(s, 8, "--tp 8")
