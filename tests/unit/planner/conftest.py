"""A tiny MoE config and a hand-made profile whose figures make the arithmetic easy."""

from __future__ import annotations

import copy

import pytest

from moeserve.planner.hardware import profile_from_dict
from moeserve.planner.model_spec import spec_from_config

TINY_CONFIG = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=16,
    hidden_size=8,
    intermediate_size=8,
    moe_intermediate_size=4,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=4,
    kv_lora_rank=4,
    qk_rope_head_dim=2,
    qk_nope_head_dim=2,
    v_head_dim=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
)


def fig(v):
    return {"value": v, "source": "assumption: test"}


PROFILE = {
    "name": "unit",
    "kind": "cpu",
    "node": {"devices": fig(2)},
    "device": {
        "matmul_tflops": {"fp32": fig(1e-3)},  # 1 GFLOP/s
        "matmul_efficiency": fig(1.0),
        "gemm_m_half": fig(0),
        "expert_efficiency": fig(1.0),
        "memory_bandwidth_gbs": fig(1.0),  # 1 GB/s
        "memory_efficiency": fig(1.0),
        "memory_gb": fig(1.0),
        "cores": fig(4),
    },
    "network": {
        "intra_node": {
            "latency_us": fig(10.0),
            "allreduce_latency_us": fig(10.0),
            "per_peer_us": fig(1.0),
            "bandwidth_gbs": fig(1.0),
        },
        "inter_node": {
            "latency_us": fig(100.0),
            "allreduce_latency_us": fig(100.0),
            "per_peer_us": fig(2.0),
            "bandwidth_gbs": fig(2.0),
        },
    },
    "software": {
        "step_overhead_us": fig(0),
        "layer_overhead_us": fig(0),
        "seq_overhead_us": fig(0),
        "seq_layer_overhead_us": fig(0),
        "op_overhead_us": fig(0),
        "collective_overhead_us": fig(0),
        "oversubscription_us": fig(0),
        "dispatch_collectives": fig(1),
        "control_collectives": fig(0),
        "comm_overlaps_compute": fig(False),
        "weight_dtype": fig("fp32"),
        "compute_dtype": fig("fp32"),
        "kv_dtype": fig("fp32"),
        "dispatch_dtype": fig("fp32"),
        "memory_reserve_fraction": fig(0.0),
    },
}


@pytest.fixture
def raw_profile():
    return copy.deepcopy(PROFILE)


@pytest.fixture
def profile():
    return profile_from_dict(copy.deepcopy(PROFILE), "unit")


@pytest.fixture
def tiny():
    return spec_from_config(dict(TINY_CONFIG), "tiny")


@pytest.fixture
def tiny_config():
    return dict(TINY_CONFIG)
