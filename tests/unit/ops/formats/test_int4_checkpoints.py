"""Published 4-bit checkpoints read as they are (``quant/int4_checkpoints.py``): AWQ and GPTQ
(v1 and v2 zero points, with and without act-order) decode to exactly what each format's own
dequantization gives, engines on such checkpoints match fp32 engines on those dequantized
weights, and bad configs or packings are clear errors at load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve import LLM
from moeserve.models.hf_config import ConfigError, ModelConfig
from moeserve.models.loader import load_model
from moeserve.models.weights import CheckpointError
from moeserve.quant.int4 import Int4Weight
from moeserve.quant.int4_checkpoints import (
    Int4CheckpointError,
    decode,
    parse_int4_config,
)
from tests.checkpoints import build_hf_model, save_hf_checkpoint
from tests.int4_checkpoints import (
    act_order_g_idx,
    awq_dequantize,
    awq_tensors,
    gptq_dequantize,
    gptq_tensors,
    quantize_asym,
    write_int4_checkpoint,
)
from tests.int8_oracle import assert_int4_outputs
from tests.unit.ops.formats.test_int4 import ENGINE, PARAMS, PROMPTS

AWQ = {"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True}
GPTQ = {"quant_method": "gptq", "bits": 4, "sym": False, "desc_act": False}


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4ckpt")
    return {
        k: save_hf_checkpoint(build_hf_model(k), root / k) for k in ("deepseek_v3", "qwen3_moe")
    }


@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize(
    "method, act_order, v1, symmetric",
    [
        ("awq", False, False, False),
        ("awq", False, False, True),
        ("gptq", False, True, False),
        ("gptq", False, False, True),
        ("gptq", True, True, True),
        ("gptq", True, False, False),
    ],
)
def test_decode_matches_each_formats_own_dequantization(G, method, act_order, v1, symmetric):
    N, K = 24, 256
    g = torch.Generator().manual_seed(G)
    w = torch.randn(N, K, generator=g)
    if method == "awq":
        parts = awq_tensors(*quantize_asym(w, G, symmetric))
        want = awq_dequantize(parts["qweight"], parts["qzeros"], parts["scales"], G)
        cfg = {**AWQ, "group_size": G, "zero_point": not symmetric}
    else:
        g_idx = act_order_g_idx(K, G, 7) if act_order else torch.arange(K) // G
        order = torch.argsort(g_idx, stable=True)
        c, z, s = quantize_asym(w[:, order], G, symmetric)
        codes = torch.empty_like(c)
        codes[:, order] = c
        parts = gptq_tensors(codes, z, s, g_idx, v1)
        want = gptq_dequantize(parts["qweight"], parts["qzeros"], parts["scales"], g_idx, v1)
        cfg = {**GPTQ, "group_size": G, "sym": symmetric, "desc_act": act_order,
               "checkpoint_format": "gptq" if v1 else "gptq_v2"}  # fmt: skip
    packed = decode(parse_int4_config(cfg, "config.json"), parts, N, K, "w")
    assert torch.equal(packed.dequantize(), want)
    assert (packed.perm is not None) == act_order
    assert (want - w).abs().max() < 0.5  # and it is the weight, 4-bit rounded
    # what an int4 weight stores of it, dequantized and read in x's column order
    held = Int4Weight((N, K), G, act_order=act_order)
    held.copy_(packed)
    x = torch.randn(3, K, generator=g)
    stored = held.dequantize()
    got = (x[:, held.perm.long()] if act_order else x) @ stored.t()
    torch.testing.assert_close(got, x @ want.t(), rtol=1e-5, atol=1e-4)


def test_shards_cut_only_between_groups():
    G, N, K = 32, 16, 128
    parts = awq_tensors(*quantize_asym(torch.randn(N, K), G))
    packed = decode(parse_int4_config({**AWQ, "group_size": G}, "c"), parts, N, K, "w")
    half = packed.narrow(1, 64, 64)
    assert torch.equal(half.dequantize(), packed.dequantize()[:, 64:])
    assert torch.equal(packed.narrow(0, 8, 8).dequantize(), packed.dequantize()[8:])
    with pytest.raises(Int4CheckpointError, match=r"columns \[48, 96\) cuts a group of 32"):
        packed.narrow(1, 48, 48)
    g_idx = act_order_g_idx(K, G, 1)
    order = torch.argsort(g_idx, stable=True)
    c, z, s = quantize_asym(torch.randn(N, K)[:, order], G)
    codes = torch.empty_like(c)
    codes[:, order] = c
    act = decode(
        parse_int4_config({**GPTQ, "group_size": G, "desc_act": True}, "c"),
        gptq_tensors(codes, z, s, g_idx),
        N,
        K,
        "w",
    )
    with pytest.raises(Int4CheckpointError, match="act-order .* cannot be split"):
        act.narrow(1, 0, 64)


@pytest.mark.parametrize(
    "quant, match",
    [
        ({**AWQ, "group_size": 128, "bits": 8}, "8-bit weights is not supported"),
        ({**AWQ, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
        ({**AWQ, "group_size": 48}, "group_size 48 is not supported"),
        ({**GPTQ, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not"),
    ],
)
def test_unreadable_configs_are_clear(fp32, tmp_path, quant, match):
    dst = tmp_path / "c"
    shutil.copytree(fp32["deepseek_v3"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dir(dst)


def test_a_packing_that_disagrees_with_its_config_is_clear(fp32, tmp_path):
    src = write_int4_checkpoint(fp32["deepseek_v3"], tmp_path / "awq", "awq", 32)
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.qzeros"
    tensors[name] = torch.cat([tensors[name]] * 2)  # zero points as if for groups of 16
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"o_proj.qzeros: expected shape \(3, 8\) .* got"):
        load_model(src, torch.float32, progress=False)
    gptq = write_int4_checkpoint(fp32["deepseek_v3"], tmp_path / "g", "gptq", 32, act_order=True)
    path = gptq / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.self_attn.o_proj.g_idx"
    tensors[name] = torch.zeros_like(tensors[name])  # every column in group 0
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="g_idx: every group must hold 32 columns"):
        load_model(gptq, torch.float32, progress=False)
    cfg = json.loads((gptq / "config.json").read_text())
    del cfg["quantization_config"]  # 4-bit tensors, but no config that says so
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="names no awq or gptq"):
        load_model(gptq, torch.float32, progress=False)


@pytest.mark.parametrize(
    "kind, method, kw",
    [
        ("deepseek_v3", "awq", {}),
        ("deepseek_v3", "gptq", dict(symmetric=True)),
        ("deepseek_v3", "gptq", dict(act_order=True, quantize_lm_head=True)),
        ("qwen3_moe", "gptq", dict(act_order=True, v1=False)),
        ("qwen3_moe", "awq", dict(quantize_lm_head=True)),
    ],
)
def test_engines_match_their_formats_dequantized_weights(fp32, tmp_path, kind, method, kw):
    src = write_int4_checkpoint(fp32[kind], tmp_path / method, method, 32, **kw)
    want = LLM(model=str(src / "oracle"), **ENGINE).generate(PROMPTS, PARAMS)
    llm = LLM(model=str(src), **ENGINE)  # no --quantization: the checkpoint's int4
    assert_int4_outputs(llm.generate(PROMPTS, PARAMS), want)
    model = llm.engine.model
    assert isinstance(model.layers[1].mlp.experts.w13_EFD, Int4Weight)
    head = model.lm_head.weight
    assert isinstance(head, Int4Weight) == kw.get("quantize_lm_head", False)
    if kw.get("act_order"):  # the experts' down orders went into their gate/up rows
        assert model.layers[1].mlp.experts.w2_EDF.perm is None


def test_asking_another_format_for_a_4bit_checkpoint_is_clear(fp32, tmp_path):
    src = write_int4_checkpoint(fp32["deepseek_v3"], tmp_path / "awq", "awq", 32)
    with pytest.raises(ValueError, match="4-bit awq checkpoint: serve it with --quantization int4"):
        LLM(model=str(src), quantization="int8", **ENGINE)
    with pytest.raises(ValueError, match="group size 32; --int4-group-size 128 cannot regroup"):
        LLM(model=str(src), quantization="int4", int4_group_size=128, **ENGINE)
