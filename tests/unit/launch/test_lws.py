from __future__ import annotations

import pytest

from moeserve.launch.lws import (
    DEFAULT_MASTER_PORT,
    LwsTopology,
    apply_lws,
    lws_topology,
)
from moeserve.launch.spec import plan_local_ranks

LEADER = "moeserve-0.moeserve.default"


def lws_env(index: int, size: int = 4, **extra: str) -> dict[str, str]:
    """What LeaderWorkerSet injects into pod ``index`` of group 0 of LWS ``moeserve``."""
    env = {
        "LWS_LEADER_ADDRESS": LEADER,
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(index),
        "HOME": "/home/moeserve",
    }
    env.update(extra)
    return env


# ---- lws_topology -------------------------------------------------------------------------------


def test_not_under_lws_is_none():
    assert lws_topology({}) is None
    assert lws_topology({"HOME": "/root", "MASTER_PORT": "1234"}) is None
    # empty values count as unset (a template that blanks them is not an LWS pod)
    assert lws_topology(dict.fromkeys(("LWS_GROUP_SIZE", "LWS_WORKER_INDEX"), "")) is None


@pytest.mark.parametrize("index", [0, 1, 3])
def test_maps_the_three_variables(index):
    topo = lws_topology(lws_env(index))
    assert topo == LwsTopology(
        nnodes=4, node_rank=index, master_addr=LEADER, master_port=DEFAULT_MASTER_PORT
    )
    assert topo.is_leader == (index == 0)


def test_master_port_from_the_environment():
    topo = lws_topology(lws_env(1, MASTER_PORT="20000"))
    assert (topo.master_port, topo.port_from_env) == (20000, True)
    assert lws_topology(lws_env(1, MASTER_PORT="  ")).port_from_env is False


def test_values_are_stripped():
    env = {"LWS_LEADER_ADDRESS": f" {LEADER}\n", "LWS_GROUP_SIZE": " 2 ", "LWS_WORKER_INDEX": "1 "}
    assert lws_topology(env) == LwsTopology(2, 1, LEADER, DEFAULT_MASTER_PORT)


@pytest.mark.parametrize("missing", ["LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"])
def test_a_missing_variable_is_named(missing):
    env = lws_env(1)
    del env[missing]
    with pytest.raises(ValueError, match=f"{missing} not set"):
        lws_topology(env)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("LWS_GROUP_SIZE", "two", "LWS_GROUP_SIZE='two' is not a non-negative integer"),
        ("LWS_GROUP_SIZE", "0", "LWS_GROUP_SIZE=0 must be >= 1"),
        ("LWS_GROUP_SIZE", "1_0", "LWS_GROUP_SIZE='1_0' is not a non-negative integer"),
        ("LWS_WORKER_INDEX", "-1", "LWS_WORKER_INDEX='-1' is not a non-negative integer"),
        ("LWS_WORKER_INDEX", "1.0", "LWS_WORKER_INDEX='1.0' is not a non-negative integer"),
        ("LWS_WORKER_INDEX", "4", r"LWS_WORKER_INDEX=4 is outside .* LWS_GROUP_SIZE=4 .* 0\.\.3"),
        ("LWS_LEADER_ADDRESS", "a b", "LWS_LEADER_ADDRESS='a b' is not a host name"),
        ("MASTER_PORT", "http", "MASTER_PORT='http' is not a non-negative integer"),
        ("MASTER_PORT", "0", "MASTER_PORT=0 is not a TCP port"),
        ("MASTER_PORT", "65536", "MASTER_PORT=65536 is not a TCP port"),
    ],
)
def test_an_invalid_value_is_named(name, value, message):
    with pytest.raises(ValueError, match=message):
        lws_topology(lws_env(1, **{name: value}))


# ---- apply_lws: flags and environment -----------------------------------------------------------


def test_outside_lws_the_flags_pass_through_with_defaults():
    assert apply_lws({}, None, None, None, None) == (1, 0, None, None)
    assert apply_lws({}, 2, 1, "10.0.0.1", 1234) == (2, 1, "10.0.0.1", 1234)


@pytest.mark.parametrize("index", range(4))
def test_the_environment_fills_in_unset_flags(index):
    assert apply_lws(lws_env(index), None, None, None, None) == (
        4,
        index,
        LEADER,
        DEFAULT_MASTER_PORT,
    )


def test_flags_that_agree_are_accepted():
    env = lws_env(2, MASTER_PORT="20000")
    assert apply_lws(env, 4, 2, LEADER, 20000) == (4, 2, LEADER, 20000)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ((2, None, None, None), "--nnodes 2 conflicts with LWS_GROUP_SIZE=4"),
        ((None, 0, None, None), "--node-rank 0 conflicts with LWS_WORKER_INDEX=1"),
        ((None, None, "10.0.0.1", None), f"--master-addr 10.0.0.1 conflicts with .*={LEADER}"),
        ((None, None, None, 1234), "--master-port 1234 conflicts with MASTER_PORT=20000"),
    ],
)
def test_a_conflicting_flag_names_both(flags, message):
    with pytest.raises(ValueError, match=message):
        apply_lws(lws_env(1, MASTER_PORT="20000"), *flags)


def test_an_explicit_port_wins_over_the_default():
    # without MASTER_PORT the port is moeserve's default, which a flag may replace
    assert apply_lws(lws_env(1), None, None, None, 1234) == (4, 1, LEADER, 1234)


def test_today_argparse_defaults_conflict_loudly():
    """Until --nnodes defaults to None, its default 1 reads as an explicit flag: a clear
    error rather than a group whose pods each think they are alone."""
    with pytest.raises(ValueError, match="--nnodes 1 conflicts with LWS_GROUP_SIZE=4"):
        apply_lws(lws_env(1), 1, 0, None, None)


def test_the_caller_environment_is_not_changed():
    env = lws_env(1)
    before = dict(env)
    apply_lws(env, None, None, None, None)
    assert env == before


# ---- the group as a whole -----------------------------------------------------------------------


def test_every_pod_of_a_group_plans_its_own_ranks():
    """Four pods of 2 ranks each (world 8): every rank appears once, on the pod LWS named."""
    ranks = []
    for index in range(4):
        nnodes, node_rank, addr, port = apply_lws(lws_env(index), None, None, None, None)
        specs = plan_local_ranks(8, nnodes, node_rank, addr, port)
        assert {s.node_rank for s in specs} == {index}
        assert {(s.master_addr, s.master_port) for s in specs} == {(LEADER, DEFAULT_MASTER_PORT)}
        ranks += [s.rank for s in specs]
    assert sorted(ranks) == list(range(8))
