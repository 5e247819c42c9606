"""Layout enumeration and the ranking under TTFT / TPOT targets."""

from __future__ import annotations

import pytest

from moeserve.planner.hardware import load_profile
from moeserve.planner.layout import Layout, enumerate_layouts
from moeserve.planner.model_spec import load_model_spec
from moeserve.planner.search import Workload, rank_layouts, sweep


def test_enumeration_of_a_two_device_node(tiny):
    lays = enumerate_layouts(tiny, nodes=1, devices_per_node=2)
    # tp1 x dp2: no EP (2 with/without TBO) + EP2 with 0 or 2 redundant (4); tp1 x pp2: 2;
    # tp2: no EP 2 + EP2 4
    assert len(lays) == 14
    assert len({lay.describe() for lay in lays}) == 14
    for lay in lays:
        assert lay.world == 2 and lay.nodes == 1
        if lay.expert_parallel:
            assert (tiny.num_experts + lay.redundant_experts) % lay.ep == 0
        else:
            assert lay.redundant_experts == 0


def test_enumeration_instances_and_mtp():
    ds = load_model_spec("deepseek-v3")
    lays = enumerate_layouts(ds, nodes=4, devices_per_node=8)
    assert {lay.nodes for lay in lays} == {1, 2, 4}
    assert {lay.mtp_depth for lay in lays} == {0, 1}
    assert all(8 % lay.tp == 0 and ds.num_heads % lay.tp == 0 for lay in lays)
    big = enumerate_layouts(ds, nodes=64, devices_per_node=8, instance_nodes=[64])
    # 512 EP ranks for 256 experts: slots padded to a multiple of the ranks
    ep512 = [lay for lay in big if lay.ep == 512]
    assert ep512 and all(lay.redundant_experts in (256, 768) for lay in ep512)


def test_layout_validation():
    with pytest.raises(ValueError, match="redundant experts need expert parallelism"):
        Layout(redundant_experts=2)
    with pytest.raises(ValueError, match="do not split over 2 nodes"):
        Layout(dp=3, nodes=2)
    assert Layout(tp=2, dp=4, expert_parallel=True).ep == 8


def test_ranking_respects_the_slos():
    ds, h800 = load_model_spec("deepseek-v3"), load_profile("h800")
    w = Workload(2000, 500, ttft_ms=2000, tpot_ms=50)
    plans = rank_layouts(ds, h800, 2, w)
    ok = [p for p in plans if p.ok]
    assert ok, "some layout serves DeepSeek-V3 on 2 H800 nodes"
    assert plans[: len(ok)] == ok  # servers first
    for p in ok:
        assert p.decode.latency_s <= 0.050 and p.prefill.latency_s <= 2.0
        assert p.decode.memory.fits and p.prefill.memory.fits
    tps = [p.serving_tps_node(w) for p in ok]
    assert tps == sorted(tps, reverse=True)
    # a looser TPOT never gives less throughput to the best layout
    loose = rank_layouts(ds, h800, 2, Workload(2000, 500, ttft_ms=2000, tpot_ms=100))
    assert loose[0].serving_tps_node(w) >= ok[0].serving_tps_node(w)


def test_nothing_fits_on_one_node():
    ds, h800 = load_model_spec("deepseek-v3"), load_profile("h800")
    plans = rank_layouts(ds, h800, 1, Workload(2000, 500))
    assert not any(p.ok for p in plans)  # 671 GB of FP8 weights > 8 x 80 GB less reserve
    assert all(any("memory" in r for r in p.reasons) for p in plans)


def test_sweep_efficiency_starts_at_one():
    q, h100 = load_model_spec("qwen3-30b-a3b"), load_profile("h100")
    pts = sweep(q, h100, [1, 2, 4], Workload(1000, 200, tpot_ms=50))
    assert [pt.nodes for pt in pts] == [1, 2, 4]
    assert pts[0].efficiency == pytest.approx(1.0)
    assert all(pt.best is not None and pt.best.layout.nodes == pt.nodes for pt in pts)


def test_skewed_routing_costs_the_busiest_rank():
    ds, h100 = load_model_spec("deepseek-v3"), load_profile("h100")
    lay = [Layout(dp=72, expert_parallel=True, redundant_experts=216, nodes=9)]
    even = rank_layouts(ds, h100, 9, Workload(2000, 100, max_decode_batch=64), layouts=lay)[0]
    skew = rank_layouts(
        ds, h100, 9, Workload(2000, 100, max_decode_batch=64, imbalance=1.5), layouts=lay
    )[0]
    assert skew.decode.batch == even.decode.batch == 64
    assert skew.decode.latency_s > even.decode.latency_s
    for name in ("experts", "dispatch", "combine"):
        assert skew.decode.step.breakdown[name] > even.decode.step.breakdown[name]


def test_sweep_copies_never_lose():
    q, h100 = load_model_spec("qwen3-30b-a3b"), load_profile("h100")
    pts = sweep(q, h100, [1, 2, 4, 8], Workload(1000, 200, tpot_ms=50))
    for pt in pts:
        assert pt.replicated_tps_node >= pt.decode_tps_node
    assert pts[0].replicated_efficiency == pytest.approx(1.0)
