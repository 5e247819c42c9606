"""The cost model on hand-computed cases: a tiny DeepSeek-like config (D 8, 2 heads, MLA ranks
4, 4 experts top-2, F 4) on a profile of 1 GFLOP/s, 1 GB/s, no overheads, so every time is
max(flops, bytes) nanoseconds."""

from __future__ import annotations

import dataclasses
import math

import pytest

from moeserve.planner import cost_model as cm
from moeserve.planner.cost_model import Rank
from moeserve.planner.layout import Layout
from moeserve.planner.simulator import attention_ops, decode_step, moe_ops


def ns(t: float) -> float:
    return t * 1e9


def test_gemm_flops_bytes_time(profile):
    op = cm.gemm(Rank.of(profile, Layout()), "x", 3, 5, 7)
    assert op.flops == 2 * 3 * 5 * 7
    assert op.bytes == 5 * 7 * 4 + (3 * 7 + 3 * 5) * 4  # weight once, input, output (fp32)
    assert ns(op.time_s) == pytest.approx(284)  # bytes bound: 284 B at 1 GB/s


def test_gemm_small_m_efficiency(raw_profile):
    from moeserve.planner.hardware import profile_from_dict

    raw_profile["device"]["gemm_m_half"]["value"] = 3
    raw_profile["device"]["memory_bandwidth_gbs"]["value"] = 1e6  # compute bound
    rank = Rank.of(profile_from_dict(raw_profile), Layout())
    op = cm.gemm(rank, "x", 3, 100, 100)
    # 3 rows reach 3 / (3 + 3) of the peak
    assert ns(op.time_s) == pytest.approx(2 * 3 * 100 * 100 * 2, rel=1e-3)


def test_mla_absorbed_decode_attention_ops(profile, tiny):
    rank = Rank.of(profile, Layout())
    ops = attention_ops(rank, tiny, T=2, seqs=2, q_per_seq=1, ctx=10, decode=True)
    got = [(o.name, o.flops, o.bytes) for o in ops if o.kind == cm.COMPUTE]
    assert got == [
        ("attn_qkv_a", 2 * 2 * 10 * 8, 10 * 8 * 4 + (2 * 8 + 2 * 10) * 4),  # q_a | kv_a fused
        ("attn_q_b", 2 * 2 * 8 * 4, 8 * 4 * 4 + (2 * 4 + 2 * 8) * 4),
        ("attn_absorb", 2 * 2 * 8 * 2, 8 * 2 * 4 + (2 * 2 + 2 * 8) * 4),  # W_UK per head
        # scores over latent+rope (6) and values over the latent (4), 2 heads, 2 x 10 tokens;
        # the latent is read once for both heads
        ("attn_core", 2 * 2 * 1 * 2 * 10 * (6 + 4), 2 * 10 * 6 * 4),
        ("attn_absorb", 2 * 2 * 4 * 4, 4 * 4 * 4 + (2 * 4 + 2 * 4) * 4),  # W_UV
        ("attn_o", 2 * 2 * 8 * 4, 8 * 4 * 4 + (2 * 4 + 2 * 8) * 4),
    ]
    assert sum(o.flops for o in ops) == 1504
    assert ops[-1].name == "tp_all_reduce" and ops[-1].time_s == 0  # tp 1: nothing


def test_mla_naive_prefill_expands_the_latent(profile, tiny):
    rank = Rank.of(profile, Layout())
    ops = {o.name: o for o in attention_ops(rank, tiny, 5, 1, 5, 5, decode=False)}
    assert ops["attn_kv_b"].flops == 2 * 5 * 2 * (2 + 2) * 4  # 5 tokens, 2 heads, nope+v
    # causal: 5 * 6 / 2 = 15 query-key pairs, 2 heads, qk 4 + v 2
    assert ops["attn_core"].flops == 2 * 2 * 15 * (4 + 2)


def test_distinct_experts_occupancy():
    assert cm.distinct_experts(256, 8, 1, 256) == pytest.approx(8)
    assert cm.distinct_experts(256, 8, 1, 32) == pytest.approx(1)
    assert cm.distinct_experts(256, 8, 0, 256) == 0
    assert cm.distinct_experts(256, 8, 10_000, 32) == pytest.approx(32)
    assert cm.distinct_experts(4, 2, 2, 4) == pytest.approx(4 * (1 - 0.25))


def test_rows_on_busiest_rank():
    assert cm.rows_on_busiest_rank(10, 1) == 10
    got = cm.rows_on_busiest_rank(1, 2)
    assert got == pytest.approx(1 + math.sqrt(2 * math.log(2)) * math.sqrt(0.5))
    assert cm.rows_on_busiest_rank(1e6, 64) / 1e6 == pytest.approx(1, abs=0.01)
    assert cm.rows_on_busiest_rank(0.01, 8) <= 0.08  # never more than every row
    assert cm.rows_on_busiest_rank(10, 4, imbalance=1.5) == pytest.approx(
        1.5 * cm.rows_on_busiest_rank(10, 4)
    )


def test_routed_experts_without_ep(profile, tiny):
    op = cm.routed_experts(Rank.of(profile, Layout()), tiny, tokens_ep=1)
    # one token, top-2 of 4: 2 experts hit, 2 rows; weights 3 x D x F per expert
    assert op.flops == 2 * 2 * 3 * 8 * 4
    assert op.bytes == 2 * 3 * 8 * 4 * 4 + 2 * (2 * 8 + 2 * 4) * 4
    assert ns(op.time_s) == pytest.approx(op.bytes)


def test_routed_experts_tp_splits_every_expert(profile, tiny):
    full = cm.routed_experts(Rank.of(profile, Layout()), tiny, 1)
    half = cm.routed_experts(Rank.of(profile, Layout(tp=2)), tiny, 1)
    assert half.flops == full.flops / 2


def test_routed_experts_under_ep(profile, tiny):
    rank = Rank.of(profile, Layout(dp=2, expert_parallel=True))
    op = cm.routed_experts(rank, tiny, tokens_ep=1)
    rows = cm.rows_on_busiest_rank(1 * 2 / 2, 2)
    assert op.flops == pytest.approx(2 * rows * 3 * 8 * 4)
    active = 2 * (1 - (1 - 2 / 4) ** 1)  # 2 of the 4 experts live here
    assert op.bytes == pytest.approx(active * 3 * 8 * 4 * 4 + rows * (16 + 8) * 4)


def test_all_to_all_inside_and_across_nodes(profile):
    one_node = Rank.of(profile, Layout(dp=4, expert_parallel=True, nodes=1))
    op = cm.all_to_all(one_node, "a2a", 4, 4000)
    # 10 us + 3 peers x 1 us; 3/4 of 4000 B at 1 GB/s
    assert op.time_s * 1e6 == pytest.approx(13 + 3)
    two_nodes = Rank.of(profile, Layout(dp=4, expert_parallel=True, nodes=2))
    op = cm.all_to_all(two_nodes, "a2a", 4, 4000)
    # inter-node latency 100 us + 1 local peer x 1 + 2 remote x 2; 2000 B over the node's
    # 2 GB/s NICs shared by its 2 ranks (2 us) vs 1000 B inside (1 us)
    assert op.time_s * 1e6 == pytest.approx(105 + 2)
    assert cm.all_to_all(one_node, "a2a", 1, 4000).time_s == 0


def test_all_reduce_ring(profile):
    rank = Rank.of(profile, Layout(tp=2))
    op = cm.all_reduce(rank, "ar", 2, 1000)
    assert op.bytes == 1000  # 2 (n-1)/n of it
    # 2 (n - 1) = 2 rounds of 1 us after the 10 us latency; 1000 B at 1 GB/s
    assert op.time_s * 1e6 == pytest.approx(10 + 2 + 1)


def test_oversubscribed_ranks_share_the_device(profile):
    alone = Rank.of(profile, Layout(dp=2, expert_parallel=True))
    crowded = Rank.of(profile, Layout(dp=8, expert_parallel=True))  # 8 ranks, 2 devices
    assert crowded.share == 4 and alone.share == 1
    assert crowded.bytes_per_s == alone.bytes_per_s / 4
    assert crowded.cpu_share == 1  # 8 cores for 8 ranks


def test_oversubscribed_collectives_wait(raw_profile):
    from moeserve.planner.hardware import profile_from_dict

    raw_profile["software"]["oversubscription_us"]["value"] = 100
    p = profile_from_dict(raw_profile)  # 2 devices x 4 cores
    fits = Rank.of(p, Layout(dp=8, expert_parallel=True))
    over = Rank.of(p, Layout(dp=16, expert_parallel=True))
    assert cm.collective_latency(over, 8) - cm.collective_latency(fits, 8) == pytest.approx(
        8 * 100e-6
    )


def test_moe_block_ep_ops(profile, tiny):
    rank = Rank.of(profile, Layout(dp=2, expert_parallel=True))
    ops, hidden = moe_ops(rank, tiny, T=4, imbalance=1.0)
    names = [o.name for o in ops]
    assert names == [
        "router",
        "dispatch",
        "experts",
        "combine",
        "shared_expert",
        "shared_expert",
        "tp_all_gather",
    ]
    by = {o.name: o for o in ops}
    # the busiest of 2 ranks gets more than the mean 8 rows; half of them stay home
    rows = cm.rows_on_busiest_rank(4 * 2, 2)
    assert rows > 8
    assert by["dispatch"].bytes == pytest.approx(rows * (8 * 4 + 8) / 2)
    assert by["combine"].bytes == pytest.approx(rows * 8 * 4 / 2)
    # communication takes the cores here, but the shared expert still runs while this rank
    # waits for the peers' rows (the all-to-all's latency)
    shared = sum(o.time_s for o in ops if o.name == "shared_expert")
    assert hidden == pytest.approx(min(shared, cm.collective_latency(rank, 2)))


def test_two_batch_overlap_needs_an_idle_resource(raw_profile, tiny):
    from moeserve.planner.hardware import profile_from_dict

    lay = Layout(dp=2, expert_parallel=True)
    tbo = dataclasses.replace(lay, two_batch_overlap=True)
    p = profile_from_dict(raw_profile)
    assert (
        decode_step(Rank.of(p, tbo), tiny, 64, 10).time_s
        > decode_step(Rank.of(p, lay), tiny, 64, 10).time_s
    )
    raw_profile["software"]["comm_overlaps_compute"]["value"] = True
    p = profile_from_dict(raw_profile)
    assert (
        decode_step(Rank.of(p, tbo), tiny, 64, 10).time_s
        < decode_step(Rank.of(p, lay), tiny, 64, 10).time_s
    )


def test_decode_step_adds_up_and_mtp(profile, tiny):
    rank = Rank.of(profile, Layout())
    step = decode_step(rank, tiny, 4, 10)
    assert step.time_s == pytest.approx(sum(step.breakdown.values()))
    mtp = Layout(mtp_depth=2, mtp_acceptance=0.8)
    assert mtp.tokens_per_step == pytest.approx(1 + 0.8 + 0.64)
    s2 = decode_step(Rank.of(profile, mtp), tiny, 4, 10)
    assert s2.breakdown["mtp"] > 0 and s2.time_s > step.time_s


def test_fp8_weights_run_at_the_fp8_rate(profile):
    from moeserve.planner.hardware import load_profile

    h800 = load_profile("h800")
    assert Rank.of(h800, Layout()).gemm_dtype == "fp8"
    assert Rank.of(h800, Layout(), weight_dtype="bf16").gemm_dtype == "bf16"
    assert Rank.of(profile, Layout(), weight_dtype="int8").gemm_dtype == "fp32"  # weight-only


def _few_row_profile(raw_profile, expert_m_half=None):
    """A few-row path up to 4 rows at 0.5 GFLOP/s, half of it at 2 rows; large GEMMs at
    1 GFLOP/s, half at 8 rows; memory fast enough that only compute counts unless raised."""
    from moeserve.planner.hardware import profile_from_dict

    dev = raw_profile["device"]
    dev["gemm_m_half"]["value"] = 8
    dev["memory_bandwidth_gbs"]["value"] = 1e6
    dev["small_gemm_max_rows"] = {"value": 4, "source": "assumption: test"}
    dev["small_gemm_tflops"] = {"value": 0.5e-3, "source": "assumption: test"}
    dev["small_gemm_m_half"] = {"value": 2, "source": "assumption: test"}
    if expert_m_half is not None:
        dev["expert_efficiency"]["value"] = 0.5
        dev["expert_m_half"] = {"value": expert_m_half, "source": "assumption: test"}
    return profile_from_dict(raw_profile)


def test_few_rows_take_their_own_gemm_path(raw_profile):
    rank = Rank.of(_few_row_profile(raw_profile), Layout())
    # 2 rows: the few-row path, 0.5 GFLOP/s * 2 / (2 + 2)
    op = cm.gemm(rank, "x", 2, 100, 100)
    assert ns(op.time_s) == pytest.approx(2 * 2 * 100 * 100 / 0.25, rel=1e-3)
    # 8 rows: beyond the path's 4, the large-GEMM rate 1 GFLOP/s * 8 / (8 + 8)
    op = cm.gemm(rank, "x", 8, 100, 100)
    assert ns(op.time_s) == pytest.approx(2 * 8 * 100 * 100 / 0.5, rel=1e-3)
    # a weight dtype the profile did not measure the path at takes the large-GEMM rate
    bf16 = Rank.of(rank.hw, Layout(), weight_dtype="bf16", compute_dtype="bf16")
    assert ns(cm.gemm(bf16, "x", 2, 100, 100).time_s) == pytest.approx(
        2 * 2 * 100 * 100 / (1.0 * 2 / (2 + 8)), rel=1e-3
    )


def test_expert_kernel_rate_curve(raw_profile, tiny):
    # tiny: 4 experts top-2, D 8, F 4; one token hits 2 experts with one row each
    rank = Rank.of(_few_row_profile(raw_profile, expert_m_half=1), Layout())
    op = cm.routed_experts(rank, tiny, tokens_ep=1)
    assert op.flops == 2 * 2 * 3 * 8 * 4
    # 1 row per expert on the few-row path: 0.5 (efficiency) * 0.5 GFLOP/s * 1 / (1 + 1)
    assert ns(op.time_s) == pytest.approx(op.flops / (0.5 * 0.5 * 0.5), rel=1e-3)


def test_expert_kernel_with_a_curve_streams_at_the_plain_rate(raw_profile, tiny):
    from moeserve.planner.hardware import profile_from_dict

    _few_row_profile(raw_profile, expert_m_half=1)
    raw_profile["device"]["memory_bandwidth_gbs"]["value"] = 1e-3  # bytes bound: 1 MB/s
    prof = profile_from_dict(raw_profile)
    op = cm.routed_experts(Rank.of(prof, Layout()), tiny, tokens_ep=1)
    # bytes at 1 MB/s, not divided by the efficiency 0.5 (the curve is the kernel's compute)
    assert op.time_s == pytest.approx(op.bytes / 1e6, rel=1e-6)
    # without a curve the bare efficiency stands for the whole kernel, bytes included
    del raw_profile["device"]["expert_m_half"]
    prof = profile_from_dict(raw_profile)
    op2 = cm.routed_experts(Rank.of(prof, Layout()), tiny, tokens_ep=1)
    assert op2.time_s == pytest.approx(op.bytes / 1e6 / 0.5, rel=1e-6)


def test_expert_blocks_are_capped_at_the_few_row_limit(raw_profile, tiny):
    rank = Rank.of(_few_row_profile(raw_profile, expert_m_half=0), Layout())
    # 100 tokens x top-2 over 4 experts: 50 rows each, run in blocks of at most 4 rows on the
    # few-row path at 0.5 (efficiency) * 0.5 GFLOP/s (m_half 0: full rate)
    op = cm.routed_experts(rank, tiny, tokens_ep=100)
    assert ns(op.time_s) == pytest.approx(op.flops / 0.25, rel=1e-3)


def test_experts_with_many_rows_run_as_plain_gemms(raw_profile, tiny):
    from moeserve.planner.hardware import profile_from_dict

    _few_row_profile(raw_profile, expert_m_half=0)
    raw_profile["device"]["expert_gemm_min_rows"] = {"value": 40, "source": "assumption: test"}
    rank = Rank.of(profile_from_dict(raw_profile), Layout())
    # 50 rows per expert >= 40: two large-GEMM calls per expert at 1 GFLOP/s * 50 / (50 + 8),
    # no expert efficiency, not capped at the few-row limit
    op = cm.routed_experts(rank, tiny, tokens_ep=100)
    assert ns(op.time_s) == pytest.approx(op.flops / (50 / 58), rel=1e-3)
    # 10 tokens: 5 rows per expert < 40, the kernel as before (0.25 GFLOP/s, blocks of 4)
    op = cm.routed_experts(rank, tiny, tokens_ep=10)
    assert ns(op.time_s) == pytest.approx(op.flops / 0.25, rel=1e-3)
    # the folded shared expert follows the same rule at T rows: 100 >= 40 -> large path
    # (tiny's shared FFN: 2 * Fs x D then D x Fs)
    ops, _ = moe_ops(rank, tiny, 100, 1.0)
    shared = [o for o in ops if o.name == "shared_expert"]
    Fs = tiny.shared_intermediate
    assert sum(ns(o.time_s) for o in shared) == pytest.approx(
        2 * 100 * 3 * Fs * tiny.hidden / (100 / 108), rel=1e-3
    )


def test_prefill_attention_efficiency(raw_profile, tiny):
    from moeserve.planner.hardware import profile_from_dict

    raw_profile["device"]["memory_bandwidth_gbs"]["value"] = 1e6  # compute bound
    base = cm.attention_prefill(Rank.of(profile_from_dict(raw_profile), Layout()), tiny, 1, 5, 0)
    # 15 causal pairs, 2 heads, qk 4 + v 2: 360 FLOPs at 1 GFLOP/s
    assert base.flops == 360 and ns(base.time_s) == pytest.approx(360, rel=1e-3)
    raw_profile["device"]["prefill_attention_efficiency"] = {"value": 0.1, "source": "test"}
    op = cm.attention_prefill(Rank.of(profile_from_dict(raw_profile), Layout()), tiny, 1, 5, 0)
    assert op.flops == 360 and ns(op.time_s) == pytest.approx(3600, rel=1e-3)
    # decode attention is another kernel: unchanged
    rank = Rank.of(profile_from_dict(raw_profile), Layout())
    assert cm.attention_decode(rank, tiny, 2, 1, 10).time_s == pytest.approx(
        cm.attention_decode(Rank.of(base_profile(raw_profile), Layout()), tiny, 2, 1, 10).time_s
    )


def base_profile(raw):
    from moeserve.planner.hardware import profile_from_dict

    raw = dict(raw, device={k: v for k, v in raw["device"].items() if "prefill_attention" not in k})
    return profile_from_dict(raw)


def test_colocated_instances_share_the_node(profile, tiny):
    """Instances on one node split its devices as the ranks of one instance do: 3 one-rank
    instances on the 2-device, 4-core profile are 1.5 ranks per device; 16 are twice the 8
    cores."""
    alone, three = Rank.of(profile, Layout()), Rank.of(profile, Layout(), colocated=3)
    assert (alone.share, three.share, three.ranks_on_node) == (1.0, 1.5, 3)
    assert three.bytes_per_s == alone.bytes_per_s / 1.5
    assert Rank.of(profile, Layout(), colocated=16).cpu_share == 2.0
    # the same share as one instance of three DP ranks on that node
    dp3 = Rank.of(profile, Layout(dp=3))
    assert three.flops_per_s == dp3.flops_per_s and three.memory_bytes == dp3.memory_bytes
    with pytest.raises(ValueError, match="colocated must be >= 1"):
        Rank.of(profile, Layout(), colocated=0)
