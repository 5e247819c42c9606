from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moeserve import demo
from moeserve.tokenizer import Tokenizer

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
    *SHARDS,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return demo.write_tiny_model(tmp_path_factory.mktemp("demo") / "model")


def _load_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in SHARDS:
        with safe_open(str(d / shard), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def test_files_present_and_index_consistent(tiny_dir):
    for name in FILES:
        assert (tiny_dir / name).is_file(), name
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(SHARDS)
    tensors = _load_all(tiny_dir)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    for shard in SHARDS:  # each shard holds exactly what the index says
        with safe_open(str(tiny_dir / shard), framework="pt") as f:
            assert {k for k, v in index["weight_map"].items() if v == shard} == set(f.keys())


def test_tensor_names_and_shapes(tiny_dir):
    t = _load_all(tiny_dir)
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["vocab_size"] == 512
    assert all(v.dtype == torch.float32 for v in t.values())
    expect = {
        "model.embed_tokens.weight": (512, 64),
        "lm_head.weight": (512, 64),
        "model.norm.weight": (64,),
        "model.layers.0.mlp.gate_proj.weight": (128, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 128),
        "model.layers.0.self_attn.q_a_proj.weight": (32, 64),
        "model.layers.0.self_attn.q_b_proj.weight": (4 * 32, 32),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (32 + 16, 64),
        "model.layers.0.self_attn.kv_b_proj.weight": (4 * 32, 32),
        "model.layers.0.self_attn.o_proj.weight": (64, 4 * 16),
        "model.layers.1.mlp.gate.weight": (16, 64),
        "model.layers.1.mlp.gate.e_score_correction_bias": (16,),
        "model.layers.2.mlp.experts.15.up_proj.weight": (32, 64),
        "model.layers.2.mlp.experts.0.down_proj.weight": (64, 32),
        "model.layers.2.mlp.shared_experts.gate_proj.weight": (32, 64),
        "model.layers.3.enorm.weight": (64,),
        "model.layers.3.hnorm.weight": (64,),
        "model.layers.3.eh_proj.weight": (64, 128),
        "model.layers.3.embed_tokens.weight": (512, 64),
        "model.layers.3.shared_head.norm.weight": (64,),
        "model.layers.3.shared_head.head.weight": (512, 64),
        "model.layers.3.mlp.experts.7.gate_proj.weight": (32, 64),
    }
    for name, shape in expect.items():
        assert tuple(t[name].shape) == shape, name
    assert "model.layers.0.mlp.gate.weight" not in t
    assert "model.layers.4.input_layernorm.weight" not in t
    assert torch.equal(t["model.layers.2.input_layernorm.weight"], torch.ones(64))
    bias = t["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max() > 0  # small random, so routing exercises it
    assert not torch.equal(
        t["model.layers.1.mlp.experts.0.up_proj.weight"],
        t["model.layers.1.mlp.experts.1.up_proj.weight"],
    )


def test_deterministic_bytes(tiny_dir, tmp_path):
    again = demo.write_tiny_model(tmp_path / "again")
    for name in FILES:
        assert demo.file_digest(tiny_dir / name) == demo.file_digest(again / name), name


def test_shipped_tokenizer_regenerates_identically():
    shipped = demo.TOKENIZER_PATH.read_text(encoding="utf-8")
    assert demo.train_demo_tokenizer() == shipped
    # and in a fresh process with another hash seed (Rust/Python hash maps differ per process)
    code = "import sys; from moeserve.demo import train_demo_tokenizer as t; sys.stdout.write(t())"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONIOENCODING": "utf-8"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, env=env, check=True
    ).stdout.decode("utf-8")
    assert out == shipped


def test_transformers_loads_it(tiny_dir):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tiny_dir, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"]  # the MTP layer, which transformers does not model
    assert all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ids = torch.tensor([tok("The lighthouse keeper").input_ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()


def test_model_config_parses(tiny_dir):
    from moeserve.models.hf_config import ModelConfig

    mc = ModelConfig.from_dir(tiny_dir)
    assert mc.num_experts == 16 and mc.num_nextn_predict_layers == 1
    assert mc.rope.type == "yarn" and mc.eos_token_ids == (1,)


def test_tokenizer_round_trips(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok.vocab_size == 512 and tok.eos_token_ids == frozenset({1})
    for line in demo.CORPUS_PATH.read_text(encoding="utf-8").splitlines()[::7]:
        ids = tok.encode(line)
        assert ids[:1] == [tok.bos_token_id]
        assert tok.decode(ids) == line
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    )
    assert text == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi 👋<｜Assistant｜>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 0 and ids[-1] == tok.token_to_id("<｜Assistant｜>") == 3
    assert ids.count(2) == 1  # <｜User｜> is one token


def test_tiny_model_path_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path / "cache"))
    p = demo.tiny_model_path()
    assert p == tmp_path / "cache" / demo.TINY_NAME
    assert all((p / f).is_file() for f in FILES)
    mtime = (p / SHARDS[0]).stat().st_mtime_ns
    assert demo.tiny_model_path() == p
    assert (p / SHARDS[0]).stat().st_mtime_ns == mtime  # not rewritten
    assert [x.name for x in (tmp_path / "cache").iterdir()] == [demo.TINY_NAME]  # no temp left


def test_tiny_model_path_ignores_half_written_temp(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path))
    stale = tmp_path / f".{demo.TINY_NAME}.tmp-crashed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    p = demo.tiny_model_path()
    assert (p / "model.safetensors.index.json").is_file()
