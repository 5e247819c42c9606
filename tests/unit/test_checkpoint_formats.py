"""Checkpoint formats end to end: DeepSeek block-FP8, both config.json forms, MTP layers,
unknown architectures, and load errors surfacing through ``LLM``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve import LLM, SamplingParams
from moeserve.models.fp8 import dequantize_fp8_block, quantize_fp8_block
from moeserve.models.hf_config import ConfigError, ModelConfig
from moeserve.models.loader import load_model
from moeserve.models.weights import CheckpointError
from tests.checkpoints import build_hf_model, save_hf_checkpoint
from tests.helpers import max_logprob_gap

# DeepSeek-V3 keeps these in bf16 in its FP8 release; every other 2-D weight is FP8
_NOT_FP8 = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory) -> Path:
    hf = build_hf_model("deepseek_v3").to(torch.bfloat16)
    return save_hf_checkpoint(hf, tmp_path_factory.mktemp("bf16"))


def _fp8_pair(src: Path, fp8_dir: Path, ref_dir: Path, block: int = 128) -> None:
    """Write an FP8 copy of ``src`` and a reference with the FP8 weights dequantized."""
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and not any(s in name for s in _NOT_FP8):
            w8, scale = quantize_fp8_block(t, block, block)
            fp8[name], fp8[name + "_scale_inv"] = w8, scale
            ref[name] = dequantize_fp8_block(w8, scale, block, block)
        else:
            fp8[name], ref[name] = t, t.float()
    for d, weights in ((fp8_dir, fp8), (ref_dir, ref)):
        shutil.copytree(src, d)
        save_file(weights, str(d / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (fp8_dir / "config.json").write_text(json.dumps(cfg))


def test_fp8_checkpoint_matches_dequantized_reference(bf16_ckpt, tmp_path):
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    _fp8_pair(bf16_ckpt, fp8_dir, ref_dir)
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.1.mlp.experts.0.up_proj.weight").dtype == (
            torch.float8_e4m3fn
        )
    ids = list(range(5, 60))
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = []
    for d in (fp8_dir, ref_dir):
        llm = LLM(model=str(d), dtype="float32", max_model_len=128, progress=False)
        outs.append(llm.generate(ids, p)[0])
    a, b = outs
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        (tx, lx), (ty, ly) = next(iter(x.items())), next(iter(y.items()))
        assert tx == ty and abs(lx.logprob - ly.logprob) < 1e-5


def test_fp8_without_scale_is_a_clear_error(bf16_ckpt, tmp_path):
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    _fp8_pair(bf16_ckpt, fp8_dir, ref_dir)
    path = fp8_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="o_proj.weight_scale_inv"):
        LLM(model=str(fp8_dir), dtype="float32", max_model_len=128, progress=False)


def test_published_and_transformers5_config_forms_agree(bf16_ckpt):
    new = json.loads((bf16_ckpt / "config.json").read_text())
    assert "rope_parameters" in new  # transformers 5 wrote it
    params = dict(new["rope_parameters"])
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_type"}
    old.pop("rope_interleave")  # absent from the published DeepSeek-V3 config; defaults True
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)
    assert ModelConfig.from_hf(old).rope.type == "yarn"


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="supported: DeepseekV3ForCausalLM, Qwen2Moe"):
        ModelConfig.from_dir(tmp_path)


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"), progress=False)
    with pytest.raises(ConfigError, match="expected config.json"):
        LLM(model=str(tmp_path), progress=False)


def test_mtp_layers_load_and_can_be_skipped(tmp_path):
    from moeserve.demo import write_tiny_model

    path = write_tiny_model(tmp_path / "demo")
    model, cfg, _ = load_model(path, torch.float32, progress=False)
    assert cfg.num_nextn_predict_layers == 1 and len(model.mtp_layers) == 1
    n = cfg.num_hidden_layers
    with open(path / "model.safetensors.index.json") as f:
        shard = json.load(f)["weight_map"][f"model.layers.{n}.eh_proj.weight"]
    with safe_open(str(path / shard), framework="pt") as f:
        want = f.get_tensor(f"model.layers.{n}.eh_proj.weight").float()
    assert torch.equal(model.mtp_layers[0].eh_proj.weight, want)
    skipped, _, report = load_model(path, torch.float32, load_mtp=False, progress=False)
    assert len(skipped.mtp_layers) == 0
    assert any(s.startswith(f"model.layers.{n}.") for s in report.skipped)


def test_bf16_compute_dtype_close_to_fp32(bf16_ckpt):
    """``dtype="bfloat16"`` computes in bf16 throughout; against an fp32 engine on the same
    (bf16, so exactly widened) checkpoint the prompt log-probabilities move by bf16 rounding:
    measured max 0.045 on these prompts (AMX, AVX2 and pure-torch paths alike), bound 0.12;
    every bf16 projection scaled by 0.97 moves them by 0.17. Greedy tokens are not compared:
    on random weights bf16 rounding can flip a near tie."""
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    # 90 prompt tokens: prefill takes the many-row paths; decode the few-row ones
    prompts = [list(range(5, 95)), [3, 17, 4, 200, 9]]
    engine = dict(model=str(bf16_ckpt), max_model_len=128, progress=False)
    want = LLM(dtype="float32", **engine).generate(prompts, p)
    llm = LLM(dtype="bfloat16", **engine)
    assert llm.engine.model.dtype == torch.bfloat16
    got = llm.generate(prompts, p)
    assert all(len(o.outputs[0].token_ids) == 4 for o in got)
    assert max_logprob_gap(got, want) < 0.12
