"""Availability under rank loss: missing experts by hand on the contiguous placement, the cost
of one loss, the time fractions, the redundancy K losses need, bad inputs, and the CLI."""

from __future__ import annotations

import json
import math

import pytest

from moeserve.planner.availability import (
    FailureModel,
    availability,
    elastic_reason,
    loss_cost,
    missing_experts,
    missing_per_domain,
    redundancy_needed,
    slots_per_rank,
)
from moeserve.planner.cli import main
from moeserve.planner.cost_model import Rank
from moeserve.planner.layout import Layout
from moeserve.planner.memory import MemoryUse, rank_memory
from moeserve.planner.model_spec import spec_from_config
from moeserve.planner.search import Workload
from moeserve.planner.simulator import prefill_step

# the tiny model with 8 experts: one expert is 3 x 8 x 4 = 96 weights, one MoE layer, fp32
EXPERT_BYTES = 96 * 4
# times that make the sums easy: detection 0.5 s, regroup 0.25 s, 1000 bytes/s from disk
FM = FailureModel(crash_fraction=1.0, crash_detect_s=0.5, regroup_s=0.25, checkpoint_read_gbs=1e-6)


@pytest.fixture
def tiny8(tiny_config):
    return spec_from_config({**tiny_config, "n_routed_experts": 8}, "tiny8")


def ep4(redundant: int, nodes: int = 1) -> Layout:
    return Layout(dp=4, expert_parallel=True, redundant_experts=redundant, nodes=nodes)


def test_contiguous_placement_by_hand():
    # E=8, EP 4, 4 redundant: [0 1 2 | 3 4 5 | 6 7 0 | 1 2 3]
    assert slots_per_rank(8, 4, 4) == 3
    assert missing_per_domain(8, 4, 4) == [0, 2, 2, 0]  # a single loss can lose 2 experts
    assert missing_experts(8, 4, 4, {1}) == 2  # 4 and 5
    assert missing_experts(8, 4, 4, {2}) == 2  # 6 and 7
    assert missing_experts(8, 4, 4, {3}) == 0
    assert missing_experts(8, 4, 4, {1, 3}) == 3  # 3 (slots 3 and 11), 4, 5
    assert missing_per_domain(8, 0, 4) == [2, 2, 2, 2]  # no copies: every loss loses S
    assert missing_per_domain(8, 8, 4) == [0, 0, 0, 0]  # [0..3 | 4..7 | 0..3 | 4..7]
    # two nodes of two ranks: node 0 holds 0..5, node 1 holds 6 7 0 1 2 3
    assert missing_per_domain(8, 4, 4, group=2) == [2, 2]


def test_one_rank_loss_by_hand(profile, tiny8):
    w = Workload(10, 4)  # a request in flight holds 10 + 4 / 2 = 12 tokens
    loss = loss_cost(spec=tiny8, hw=profile, layout=ep4(4), w=w, in_flight=6, fm=FM)
    # over ranks 1..3 (rank 0 is a restart): 2, 2, 0 experts without a copy
    assert loss.missing_experts_mean == pytest.approx(4 / 3)
    assert loss.missing_experts_worst == 2
    assert loss.missing_experts_bound == 3  # any placement: the dead rank's 3 slots
    assert loss.expert_bytes == EXPERT_BYTES
    assert loss.reload_bytes_mean == pytest.approx(512.0)
    assert loss.reload_bytes_worst == 768.0
    assert loss.recompute_tokens == 72.0
    assert loss.survivor_batch == 2  # 6 requests over 3 survivors
    rank = Rank.of(profile, ep4(4))
    step = prefill_step(rank, tiny8, 2, 12.0, 0.0).time_s  # one step: 24 tokens < 16384
    assert step > 0 and loss.recompute_s == pytest.approx(step)
    assert loss.slots_hold and loss.kv_holds and loss.survives and loss.reason == ""
    assert loss.recovery_s == pytest.approx(0.5 + 0.25 + 0.512 + step)
    assert loss.recovery_s_worst == pytest.approx(0.5 + 0.25 + 0.768 + step)


def test_survivors_without_enough_slots(profile, tiny8):
    loss = loss_cost(tiny8, profile, ep4(0), Workload(10, 4), 6, FM)  # 3 ranks x 2 slots < 8
    assert not loss.slots_hold and not loss.survives
    assert loss.reason == "too few slots for the experts"
    assert loss.missing_experts_mean == 2 and loss.reload_bytes_mean == 2 * EXPERT_BYTES


def test_survivors_slots_exactly_enough(profile, tiny8):
    # EP 3, 4 redundant: [0 1 2 3 | 4 5 6 7 | 0 1 2 3]; losing rank 1 leaves 8 slots for 8
    lay = Layout(dp=3, expert_parallel=True, redundant_experts=4)
    assert missing_per_domain(8, 4, 3) == [0, 4, 0]
    loss = loss_cost(tiny8, profile, lay, Workload(10, 4), 3, FM)
    assert loss.slots_hold and loss.missing_experts_mean == 2 and loss.missing_experts_worst == 4
    lay = Layout(dp=3, expert_parallel=True, redundant_experts=1)  # 2 x 3 slots < 8
    assert not loss_cost(tiny8, profile, lay, Workload(10, 4), 3, FM).slots_hold


def test_survivors_kv_must_hold_the_requests(profile, tiny8):
    # a rank gets half a device: 0.5 GB; a request holds 2000 tokens x 6 x 2 layers x 4 B
    w = Workload(1000, 1000)
    rank = Rank.of(profile, ep4(4))
    fits = loss_cost(tiny8, profile, ep4(4), w, 12000, FM)  # 4000 per survivor: 384 MB
    assert fits.survivor_batch == 4000 and fits.kv_holds
    over = loss_cost(tiny8, profile, ep4(4), w, 18000, FM)  # 6000 per survivor: 576 MB
    assert over.survivor_batch == 6000 and not over.kv_holds and not over.survives
    assert over.reason == "the requests' KV does not fit"
    assert rank_memory(rank, tiny8, 4500, 2000, 4500, 4500).fits  # before: 4500 per rank


def test_availability_by_hand(profile, tiny8):
    # every failure takes one rank; rank 0 (1 in 4) restarts in 100 s, the others recover
    # at once (8 redundant: no expert missing, nothing in flight) and run at 3/4 for 1000 s
    fm = FailureModel(
        node_mtbf_hours=1.0,
        rank_fault_fraction=1.0,
        crash_fraction=1.0,
        crash_detect_s=0.0,
        regroup_s=0.0,
        restart_s=100.0,
        rejoin_s=1000.0,
    )
    a = availability(tiny8, profile, ep4(8), Workload(10, 4), 0, fm)
    assert a.rank_loss.recovery_s == 0.0 and a.node_loss is None
    cycle = 3600 + 0.25 * 100
    assert a.restart_probability == 0.25
    assert a.down_s_per_failure == 25.0 and a.degraded_s_per_failure == 750.0
    assert a.down_fraction == pytest.approx(25 / cycle)
    assert a.degraded_fraction == pytest.approx(750 / cycle)
    assert a.full_fraction == pytest.approx(1 - 775 / cycle)
    assert a.capacity_fraction == pytest.approx(1 - (25 + 750 / 4) / cycle)
    assert a.failures_per_period == 720.0
    assert a.down_s_per_period == pytest.approx(25 / cycle * 30 * 86400)


def test_restart_seconds_derived_from_the_weights(profile, tiny8):
    from moeserve.planner.memory import stage_weight_bytes

    fm = FailureModel(restart_fixed_s=60.0, checkpoint_read_gbs=1e-6, crash_fraction=1.0)
    a = availability(tiny8, profile, ep4(4), Workload(10, 4), 0, fm)
    node = 4 * stage_weight_bytes(Rank.of(profile, ep4(4)), tiny8)  # 4 ranks on the node
    assert a.restart_s == pytest.approx(fm.crash_detect_s + 60.0 + node / 1000)


def test_no_elastic_layout_restarts_on_every_loss(profile, tiny8):
    lay = Layout(tp=2, dp=2, expert_parallel=True)
    assert "TP 1" in elastic_reason(lay)
    fm = FailureModel(node_mtbf_hours=1.0, restart_s=100.0, crash_fraction=1.0, crash_detect_s=0)
    a = availability(tiny8, profile, lay, Workload(10, 4), 4, fm)
    assert a.rank_loss is None and a.restart_probability == 1.0
    assert a.down_fraction == pytest.approx(100 / 3700) and a.degraded_fraction == 0.0
    with pytest.raises(ValueError, match="elastic EP needs EP, TP 1 and PP 1"):
        loss_cost(tiny8, profile, lay, Workload(10, 4), 4, fm)


def test_node_loss(profile, tiny8):
    lay = ep4(4, nodes=2)
    node = loss_cost(tiny8, profile, lay, Workload(10, 4), 6, FM, unit="node")
    assert node.ranks_lost == 2 and node.missing_experts_mean == 2  # node 1 alone
    assert node.missing_experts_bound == 6 and not node.slots_hold  # 2 ranks x 3 slots < 8
    fm = FailureModel(rank_fault_fraction=0.5)
    a = availability(tiny8, profile, lay, Workload(10, 4), 6, fm)
    # rank 0 (1/4 of rank faults) and every node failure (node 0's, or too few slots)
    assert a.restart_probability == pytest.approx(0.5 / 4 + 0.5)
    with pytest.raises(ValueError, match="node loss takes rank 0"):
        loss_cost(tiny8, profile, ep4(4), Workload(10, 4), 6, FM, unit="node")


def test_more_redundancy_fewer_reload_bytes(profile, tiny8):
    w = Workload(10, 4)
    reload = [loss_cost(tiny8, profile, ep4(r), w, 6, FM).reload_bytes_mean for r in (0, 4, 8)]
    assert reload == pytest.approx([2 * EXPERT_BYTES, 512.0, 0.0])


def test_higher_mtbf_higher_availability(profile, tiny8):
    res = [
        availability(tiny8, profile, ep4(4), Workload(10, 4), 6, FailureModel(node_mtbf_hours=h))
        for h in (100.0, 1000.0, 10000.0)
    ]
    serving = [1 - a.down_fraction for a in res]
    capacity = [a.capacity_fraction for a in res]
    assert serving[0] < serving[1] < serving[2] < 1
    assert capacity[0] < capacity[1] < capacity[2] < 1


def test_redundancy_needed_by_hand(profile, tiny8):
    lay = ep4(4)
    one = redundancy_needed(tiny8, profile, lay, 1)
    # survive: 3 survivors need 8 slots (S = 3, r4); no reload: each expert on 2 ranks (r8)
    assert (one.survive.redundant_experts, one.no_reload.redundant_experts) == (4, 8)
    assert one.survive.extra_weight_bytes_per_rank == 0.0
    assert one.no_reload.extra_weight_bytes_per_rank == EXPERT_BYTES  # one slot more per rank
    assert one.no_reload.fits is None
    # r12 leaves expert 4 on ranks 0 and 2 only; r16 puts every expert on 3 ranks
    two = redundancy_needed(tiny8, profile, lay, 2)
    assert (two.survive.redundant_experts, two.no_reload.redundant_experts) == (8, 16)
    three = redundancy_needed(tiny8, profile, lay, 3)
    assert (three.survive.redundant_experts, three.no_reload.redundant_experts) == (24, 24)
    four = redundancy_needed(tiny8, profile, lay, 4)
    assert four.survive.redundant_experts is None and four.no_reload.redundant_experts is None
    # a node of 2 ranks: each expert on both nodes needs S = 4 (r8)
    node = redundancy_needed(tiny8, profile, ep4(4, nodes=2), 1, unit="node")
    assert (node.survive.redundant_experts, node.no_reload.redundant_experts) == (8, 8)
    # memory: the plan's use plus one slot more per rank against the capacity
    mem = MemoryUse(weights=100.0, kv_cache=0.0, activations=0.0, capacity=100.0 + EXPERT_BYTES)
    assert redundancy_needed(tiny8, profile, lay, 1, memory=mem).no_reload.fits is True
    mem = MemoryUse(weights=101.0, kv_cache=0.0, activations=0.0, capacity=100.0 + EXPERT_BYTES)
    assert redundancy_needed(tiny8, profile, lay, 1, memory=mem).no_reload.fits is False
    assert "1 rank loss(es): survive r4" in one.describe()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(node_mtbf_hours=0.0), "node_mtbf_hours must be > 0, got 0.0"),
        (dict(crash_fraction=1.5), r"crash_fraction must be in \[0, 1\], got 1.5"),
        (dict(rejoin_s=-1.0), "rejoin_s must be >= 0, got -1.0"),
        (dict(regroup_s=math.nan), "regroup_s must be >= 0, got nan"),
        (dict(checkpoint_read_gbs="fast"), "checkpoint_read_gbs must be > 0, got 'fast'"),
    ],
)
def test_failure_model_rejects_bad_figures(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FailureModel(**kwargs)


def test_bad_inputs(profile, tiny8):
    w = Workload(10, 4)
    with pytest.raises(ValueError, match="do not split over EP 4"):
        slots_per_rank(8, 3, 4)
    with pytest.raises(ValueError, match=r"dead EP ranks \[4\] lie outside \[0, 4\)"):
        missing_experts(8, 4, 4, {4})
    with pytest.raises(ValueError, match="in_flight must be >= 0"):
        loss_cost(tiny8, profile, ep4(4), w, -1)
    with pytest.raises(ValueError, match="failure unit must be one of rank, node"):
        loss_cost(tiny8, profile, ep4(4), w, 1, unit="rack")
    with pytest.raises(ValueError, match="an integer >= 1, got 0"):
        redundancy_needed(tiny8, profile, ep4(4), 0)
    with pytest.raises(ValueError, match="redundant experts need expert parallelism"):
        redundancy_needed(tiny8, profile, Layout(dp=4), 1)


DSV3 = ["--model", "deepseek-v3", "--hardware", "h800", "--tpot-ms", "55"]
DSV3_R32 = [*DSV3, "--layout", "dp=16,ep=1,redundant=32,tbo=1,nodes=2"]


def test_cli_json_has_availability(capsys):
    assert main([*DSV3_R32, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "availability" not in plain["plans"][0] and "failure_model" not in plain
    assert main([*DSV3_R32, "--json", "--node-mtbf-hours", "1000", "--tolerate-failures", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["failure_model"]["node_mtbf_hours"] == 1000.0
    assert "Llama 3" in out["failure_model"]["sources"]["rank_fault_fraction"]
    a = out["plans"][0]["availability"]
    assert a["instance_mtbf_hours"] == 500.0 and a["elastic_reason"] == ""
    # EP 16 with 288 slots (S = 18): ranks 2..13 hold only sole copies, rank 1 and rank 14
    # four each, rank 15 none: (12 x 18 + 4 + 4) / 15
    rank = a["rank_loss"]
    assert rank["missing_experts_worst"] == 18
    assert rank["missing_experts_mean"] == pytest.approx(224 / 15)
    assert rank["survives"] and rank["slots_hold"]  # 15 x 18 = 270 >= 256
    assert not a["node_loss"]["survives"]  # 8 x 18 = 144 < 256
    red = out["plans"][0]["redundancy"]
    assert red["survive"]["redundant_experts"] == 32
    assert red["no_reload"]["redundant_experts"] == 256 and red["no_reload"]["fits"] is False


def test_cli_text_has_availability(capsys):
    assert main(DSV3_R32) == 0
    assert "availability:" not in capsys.readouterr().out
    assert main([*DSV3_R32, "--availability", "--tolerate-failures", "1"]) == 0
    text = capsys.readouterr().out
    assert "availability: node MTBF 6300 h" in text
    assert "rank 14.9/18" in text and "restart (too few slots for the experts)" in text
    assert "1 rank loss(es): survive r32 (+0.00 GB/rank, fits)" in text


def test_cli_availability_errors(capsys):
    assert main([*DSV3_R32, "--tolerate-failures", "0"]) == 2
    assert "--tolerate-failures must be >= 1" in capsys.readouterr().err
    assert main([*DSV3, "--availability", "--sweep-nodes", "1,2"]) == 2
    assert "not with --sweep-nodes" in capsys.readouterr().err
    assert main([*DSV3_R32, "--node-mtbf-hours", "-5"]) == 2
    assert "node_mtbf_hours must be > 0" in capsys.readouterr().err
