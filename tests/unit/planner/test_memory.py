"""Weights, KV cache and activations per rank, and the fit at its edge."""

from __future__ import annotations

import dataclasses

import pytest

from moeserve.planner.cost_model import Rank
from moeserve.planner.hardware import profile_from_dict
from moeserve.planner.layout import Layout
from moeserve.planner.memory import MemoryUse, kv_cache_bytes, rank_memory, stage_weight_bytes
from moeserve.planner.search import Workload, decode_plan, evaluate


def test_weights_by_hand(profile, tiny):
    # attention 176 (q_a 32, q_b 32, kv_a 48, kv_b 32, o 32), dense MLP 192, experts 4 x 96,
    # shared 96, router 32, embedding and head 128 each; fp32
    assert tiny.attention_params() == 176
    assert tiny.total_params() == 1312
    assert stage_weight_bytes(Rank.of(profile, Layout()), tiny) == 1312 * 4
    ep2 = Rank.of(profile, Layout(dp=2, expert_parallel=True))
    assert stage_weight_bytes(ep2, tiny) == (1312 - 2 * 96) * 4  # half of the experts
    r2 = Rank.of(profile, Layout(dp=2, expert_parallel=True, redundant_experts=2))
    assert stage_weight_bytes(r2, tiny) == (1312 - 2 * 96 + 96) * 4  # one copy more each
    # pp 2: stage 0 = dense layer + embedding (368 + 128), stage 1 = MoE layer + head
    assert stage_weight_bytes(Rank.of(profile, Layout(pp=2)), tiny) == (688 + 128) * 4


def test_kv_cache_by_hand(profile, tiny):
    rank = Rank.of(profile, Layout())
    # latent 4 + rope 2 per token per layer, 2 layers, fp32
    assert kv_cache_bytes(rank, tiny, 3, 10) == 3 * 10 * 6 * 2 * 4
    # MLA's latent is replicated over TP ranks
    assert kv_cache_bytes(Rank.of(profile, Layout(tp=2)), tiny, 3, 10) == 3 * 10 * 6 * 2 * 4


def test_gqa_kv_heads_split_but_never_below_one():
    from moeserve.planner.model_spec import load_model_spec

    q = load_model_spec("qwen3-30b-a3b")  # 4 KV heads of 128
    assert q.kv_elems_per_token_layer(1) == 2 * 4 * 128
    assert q.kv_elems_per_token_layer(2) == 2 * 2 * 128
    assert q.kv_elems_per_token_layer(8) == 2 * 1 * 128


def test_fit_at_the_edge():
    use = MemoryUse(weights=100, kv_cache=20, activations=5, capacity=125)
    assert use.fits
    assert not dataclasses.replace(use, capacity=124).fits


def test_search_batch_flips_at_one_byte(raw_profile, tiny):
    """Capacity exactly the need of batch 8 picks 8; one byte less picks 7."""
    w = Workload(input_len=6, output_len=4, max_decode_batch=64)
    need = decode_plan(tiny, Rank.of(profile_from_dict(raw_profile), Layout()), w, 8).memory
    for capacity, want in ((need.total, 8), (need.total - 1, 7)):
        raw_profile["device"]["memory_gb"]["value"] = capacity / 1e9
        p = profile_from_dict(raw_profile)
        assert Rank.of(p, Layout()).memory_bytes == capacity
        plan = evaluate(tiny, p, Layout(), w)
        assert plan.decode.batch == want


def test_weights_that_do_not_fit_say_so(raw_profile, tiny):
    raw_profile["device"]["memory_gb"]["value"] = 1000 / 1e9  # 1000 bytes
    plan = evaluate(tiny, profile_from_dict(raw_profile), Layout(), Workload(4, 4))
    assert not plan.ok and "does not fit in memory" in plan.reasons[0]


def test_rank_memory_parts(profile, tiny):
    rank = Rank.of(profile, Layout())
    use = rank_memory(rank, tiny, 2, 10, 2, 2)
    assert use.total == use.weights + use.kv_cache + use.activations
    assert use.capacity == pytest.approx(1e9)
