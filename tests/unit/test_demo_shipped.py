"""The trained demo model shipped in moeserve/data/demo_model: what scripts/train_demo.py
writes, read the same way by moeserve and transformers, the default of every command."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from moeserve import demo
from moeserve.tokenizer import Tokenizer
from tests.served_checkpoint import check_served_checkpoint


@pytest.fixture(scope="module")
def shipped():
    return demo.demo_model_path()


def test_the_shipped_directory_is_a_deepseek_v3_with_an_mtp_layer(shipped):
    cfg = json.loads((shipped / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["first_k_dense_replace"] == 1
    assert cfg["q_lora_rank"] and cfg["kv_lora_rank"] and cfg["n_shared_experts"] == 1
    n = cfg["num_hidden_layers"]
    with safe_open(str(shipped / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {k: f.get_slice(k).get_dtype() for k in names}
    mtp = f"model.layers.{n}."
    for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head"):
        assert f"{mtp}{part}.weight" in names, part
    assert f"model.layers.{n + 1}.input_layernorm.weight" not in names
    routers = [k for k in names if k.endswith(("mlp.gate.weight", "e_score_correction_bias"))]
    assert len(routers) == 2 * n  # n - 1 MoE layers and the MTP layer: a weight and a bias each
    assert all(dtypes[k] == "F32" for k in routers)
    assert all(dtypes[k] == "BF16" for k in names - set(routers))
    tok = Tokenizer.from_dir(shipped)
    assert tok.vocab_size == cfg["vocab_size"] and tok.eos_token_ids == frozenset({1})
    for i, special in enumerate(demo.SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i
    for marker in demo.MARKER_TOKENS:  # the tool-call and thinking parsers need them whole
        assert tok.token_to_id(marker) is not None
    tcfg = json.loads((shipped / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == demo.CHAT_TEMPLATE


def test_write_demo_model_copies_the_shipped_files(shipped, tmp_path):
    out = demo.write_demo_model(tmp_path / "copy")
    for name in demo.DEMO_FILES:
        assert demo.file_digest(out / name) == demo.file_digest(shipped / name), name


def test_a_missing_demo_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="lacks config.json, generation_config.json"):
        demo.demo_model_path()


def test_moeserve_and_transformers_read_the_same_model(shipped):
    """Prompt logprobs of a held-out sentence agree with transformers' (both in fp32 from
    the bf16 weights), and the trained MTP layer drafting keeps the greedy tokens."""
    prompt = "The dictionary maps each key to a value, and the keys must be hashable."
    got = check_served_checkpoint(shipped, prompt, max_tokens=12)
    # a trained model: the sentence is far likelier than under a uniform guess (-7.6)
    assert got.mean() > -4.0
