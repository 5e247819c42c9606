"""Model specs from config.json: the built-in published configs and their derived sizes."""

from __future__ import annotations

import json

import pytest

from moeserve.planner.model_spec import ModelSpecError, load_model_spec, spec_from_config


def test_deepseek_v3_published_sizes():
    s = load_model_spec("deepseek-v3")
    assert (s.arch, s.num_layers, s.num_dense_layers, s.num_experts, s.top_k) == (
        "deepseek_v3",
        61,
        3,
        256,
        8,
    )
    assert s.is_mla and s.kv_elems_per_token_layer() == 512 + 64
    assert s.shared_intermediate == 2048 and s.num_mtp_layers == 1
    assert s.checkpoint_weight_bytes == 1  # FP8
    # 671B total (with the 14B MTP module: 685B on disk), 37B active
    assert s.total_params() / 1e9 == pytest.approx(671, rel=0.01)
    assert s.active_params() / 1e9 == pytest.approx(37.5, rel=0.03)


def test_qwen3_published_sizes():
    small, big = load_model_spec("qwen3-30b-a3b"), load_model_spec("qwen3-235b-a22b")
    assert small.total_params() / 1e9 == pytest.approx(30.5, rel=0.02)
    assert small.active_params() / 1e9 == pytest.approx(3.3, rel=0.05)
    assert big.total_params() / 1e9 == pytest.approx(235, rel=0.01)
    assert big.active_params() / 1e9 == pytest.approx(22, rel=0.03)
    assert not small.is_mla and small.num_dense_layers == 0


def test_directory_and_file_inputs(tmp_path):
    raw = json.loads(
        (load_model_spec.__globals__["BUILTIN_DIR"] / "qwen3-30b-a3b.json").read_text()
    )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_model_spec(tmp_path).name == tmp_path.name
    assert load_model_spec(tmp_path / "config.json").num_experts == 128
    with pytest.raises(ModelSpecError, match="expected config.json in"):
        load_model_spec(tmp_path / "..")


def test_qwen2_shared_expert_and_sparse_step():
    s = spec_from_config(
        dict(
            model_type="qwen2_moe",
            vocab_size=10,
            hidden_size=8,
            num_hidden_layers=4,
            num_attention_heads=2,
            moe_intermediate_size=4,
            num_experts=4,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=16,
            decoder_sparse_step=2,
            intermediate_size=8,
        )
    )
    assert s.shared_intermediate == 16 and s.num_dense_layers == 2


def test_unsupported_and_incomplete():
    with pytest.raises(ModelSpecError, match="model_type 'llama' .* not modelled"):
        spec_from_config({"model_type": "llama"})
    with pytest.raises(ModelSpecError, match="lacks 'hidden_size'"):
        spec_from_config({"model_type": "qwen3_moe"})
    with pytest.raises(ModelSpecError, match="not a config.json, a model directory"):
        load_model_spec("no-such-model")
