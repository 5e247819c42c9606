"""``--quantization bf16``: weights held in bf16, activations fp32. Against an fp32 engine on
the same checkpoint with its weights rounded to bf16 (the oracle): equal up to summation
order where the GEMMs widen the weights (no AMX), within bf16 rounding of the activations
where they run on AMX (``ops/cpu/bf16_amx.c``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import EngineConfig
from moeserve.models.loader import load_model
from moeserve.ops import formats
from moeserve.ops.cpu import bf16_amx
from tests.checkpoints import build_hf_model, save_hf_checkpoint
from tests.helpers import max_logprob_gap
from tests.int8_oracle import write_oracle

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
ENGINE = dict(dtype="float32", max_model_len=160, progress=False)
# 90 prompt tokens: prefill takes the many-row paths; decode the few-row ones
PROMPTS = [list(range(5, 95)), [3, 17, 4, 200, 9]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16")
    out = {}
    # deepseek_v3 as built elsewhere has head dims the AMX tiles do not take (16, 24), so its
    # absorbed MLA products widen their weights; deepseek_amx has every GEMM on the tiles
    models = {
        "deepseek_v3": build_hf_model("deepseek_v3"),
        "deepseek_amx": build_hf_model("deepseek_v3", qk_nope_head_dim=32, v_head_dim=32),
        "qwen3_moe": build_hf_model("qwen3_moe"),
    }
    for kind, model in models.items():
        src = save_hf_checkpoint(model, root / kind)
        out[kind] = src
        out[f"{kind}-oracle"] = write_bf16_oracle(src, root / f"{kind}-oracle")
    return out


def write_bf16_oracle(src: Path, dst: Path) -> Path:
    """``src`` with every weight the format converts rounded to bf16 (stored in fp32)."""
    return write_oracle(src, dst, lambda name, t: t.bfloat16().float())


def _generate(path: Path, **kw):
    return LLM(model=str(path), **{**ENGINE, **kw}).generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_moe"])
def test_widened_weights_match_the_oracle(checkpoints, kind, monkeypatch):
    """Without AMX each GEMM widens its bf16 weight (the fp32 row kernels in registers, or
    torch per call): the oracle's arithmetic, up to the order of the fp32 sums."""
    monkeypatch.setattr(bf16_amx, "available", lambda: False)
    want = _generate(checkpoints[f"{kind}-oracle"])
    got = _generate(checkpoints[kind], quantization="bf16")
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert max_logprob_gap(got, want) < 1e-4


@pytest.mark.skipif(not bf16_amx.available(), reason="no AMX here")
@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_amx", "qwen3_moe"])
def test_amx_engine_close_to_the_oracle(checkpoints, kind):
    """On AMX the activations are rounded to bf16 inside each GEMM: prompt log-probabilities
    move by bf16 rounding (measured max 0.03, 0.005 and 0.04 on these checkpoints), far less
    than a broken kernel moves them."""
    want = _generate(checkpoints[f"{kind}-oracle"])
    got = _generate(checkpoints[kind], quantization="bf16")
    assert max_logprob_gap(got, want) < 0.1


def test_what_is_converted_and_what_stays(checkpoints):
    model, _, _ = load_model(checkpoints["deepseek_v3"], torch.float32, weight_format="bf16")
    layer = model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    for w in (attn.q_b_proj.weight, attn.kv_b_proj.weight, attn.o_proj.weight):
        assert w.dtype == torch.bfloat16
    assert mlp.experts.w13_EFD.dtype == mlp.experts.w2_EDF.dtype == torch.bfloat16
    assert attn.w_uk_HCN.dtype == torch.bfloat16  # absorbed from the bf16 kv_b_proj
    assert mlp.gate.weight.dtype == torch.float32  # the router stays fp32
    assert model.embed_tokens.weight.dtype == torch.float32
    assert layer.input_layernorm.weight.dtype == torch.float32


def test_config_keeps_fp32_activations():
    cfg = EngineConfig(model="m", quantization="bf16", device="cpu")
    assert formats.resolve(cfg.quantization, cfg.dtype, cfg.torch_device) == (
        "bf16",
        torch.float32,
    )
    with pytest.raises(ValueError, match="bf16"):
        EngineConfig(model="m", quantization="bf8")


@pytest.mark.parametrize("amx_here", [True, False])
def test_auto_dtype_picks_bf16_weights_where_amx_runs(monkeypatch, amx_here):
    """``dtype="auto"`` on a CPU with AMX: bf16 weights, fp32 activations; without AMX the
    dtype alone decides (bf16 throughout on a CPU with fast bf16); an explicit dtype or
    quantization is kept."""
    import moeserve.platform as platform

    def resolve(cfg: EngineConfig):
        return formats.resolve(cfg.quantization, cfg.dtype, cfg.torch_device)

    monkeypatch.setattr(bf16_amx, "available", lambda: amx_here)
    monkeypatch.setattr(platform, "cpu_has_fast_bf16", lambda: True)
    auto = EngineConfig(model="m", device="cpu")
    if amx_here:
        assert resolve(auto) == ("bf16", torch.float32)
    else:
        assert resolve(auto) == (None, torch.bfloat16)
    explicit = EngineConfig(model="m", device="cpu", dtype="float32")
    assert resolve(explicit) == (None, torch.float32)
    int8 = EngineConfig(model="m", device="cpu", quantization="int8")
    assert resolve(int8) == ("int8", torch.float32)
    monkeypatch.setattr(platform, "cpu_has_fast_bf16", lambda: False)  # AVX2 only: fp32
    assert resolve(auto) == (None, torch.float32)


@pytest.mark.parametrize("amx", [True, False])
def test_decode_calls_bind_and_match_the_torch_path(checkpoints, monkeypatch, amx):
    """Decode steps run as the prebound kernel calls (MLA and MoE) on bf16 weights, and agree
    with the layers' torch paths, which run the same kernels one op at a time: on AMX, and
    without it on the fp32 row kernels' bf16 bodies."""
    from moeserve.ops.cpu import fp32 as fp32_kernels
    from moeserve.ops.cpu.mla_decode import MLADecodeCalls
    from moeserve.ops.cpu.moe_decode import MoEDecodeCalls

    if amx and not bf16_amx.available():
        pytest.skip("no AMX here")
    if not amx:
        if not fp32_kernels.available():
            pytest.skip("no CPU kernels here")
        monkeypatch.setattr(bf16_amx, "available", lambda: False)

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(model=str(checkpoints["deepseek_amx"]), quantization="bf16", **ENGINE)
    bound = llm.generate(PROMPTS, params)
    layer = llm.engine.model.layers[1]
    assert isinstance(layer.self_attn._decode_calls, MLADecodeCalls)
    assert isinstance(layer.mlp._decode_calls, MoEDecodeCalls)
    monkeypatch.setattr(MLADecodeCalls, "bind", staticmethod(lambda *a: None))
    monkeypatch.setattr(MoEDecodeCalls, "bind", staticmethod(lambda *a: None))
    torch_path = LLM(model=str(checkpoints["deepseek_amx"]), quantization="bf16", **ENGINE)
    want = torch_path.generate(PROMPTS, params)
    for a, b in zip(bound, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            (tx, lx), (ty, ly) = next(iter(x.items())), next(iter(y.items()))
            assert tx == ty and abs(lx.logprob - ly.logprob) < 1e-4
