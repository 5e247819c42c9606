"""``--quantization w8a8_int8``: int8 weights (per output row) and each GEMM's input rows
quantized to int8 per token. Checked:

- each dispatch (``linear``, ``BoundLinear``, ``experts_sorted``), with and without the AMX
  kernels, against the format's references (``ops/cpu/int8_amx.py``);
- the engine on AMX (``ops/cpu/int8_amx.c``) against the same format without it (the rows
  rounded to their int8 grids in torch, then the weight-only int8 paths). The grids are the
  same, but fp32 sums in another order move a few values across a rounding boundary of the
  next GEMM's grid, and these random models amplify that: gaps of 0.01-0.02 where a dropped
  scale moves them by more than 1;
- against the fp32 oracle of the int8 weights (``tests/int8_oracle``): only the activations'
  rounding separates them, a bounded drift;
- the prebound decode calls against the layers' torch paths (the same kernels: 1e-4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import EngineConfig
from moeserve.models.loader import load_model
from moeserve.ops import formats
from moeserve.ops.cpu import bf16_amx, int8_amx
from moeserve.ops.linear import BoundLinear, linear, linear_into
from moeserve.ops.moe import experts_sorted
from moeserve.quant.head_codes import HeadCodes
from moeserve.quant.int8 import Int8Tensor, Int8Weight, quantize_rows
from tests.checkpoints import DEEPSEEK_TILES, build_hf_model, save_hf_checkpoint
from tests.helpers import max_logprob_gap
from tests.int8_oracle import write_int8_oracle

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
ENGINE = dict(dtype="float32", max_model_len=160, progress=False)
# 90 prompt tokens: prefill takes the many-row paths; decode the few-row ones
PROMPTS = [list(range(5, 95)), [3, 17, 4, 200, 9]]
needs_amx = pytest.mark.skipif(not int8_amx.available(), reason="no AMX-INT8 here")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("w8a8")
    out = {}
    # deepseek_tiles has every GEMM on the int8 tiles (K % 64, N % 16) and the absorbed MLA
    # products on the bf16 ones; qwen3_moe's experts (F 32) take the per-expert fallback
    models = {
        "deepseek_tiles": build_hf_model("deepseek_v3", **DEEPSEEK_TILES),
        "qwen3_moe": build_hf_model("qwen3_moe"),
    }
    for kind, model in models.items():
        src = save_hf_checkpoint(model, root / kind)
        out[kind] = src
        out[f"{kind}-oracle"] = write_int8_oracle(src, root / f"{kind}-oracle")
    return out


def _generate(path: Path, params: SamplingParams = PARAMS, **kw):
    return LLM(model=str(path), **{**ENGINE, **kw}).generate(PROMPTS, params)


def w8a8_weight(*shape: int, seed: int) -> Int8Tensor:
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_rows(torch.randn(*shape, generator=g) / shape[-1] ** 0.5)
    return Int8Tensor(q, scale, weight_format="w8a8_int8")


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("M", [1, 40])
def test_projections_round_their_rows_on_every_path(M, tiles, monkeypatch):
    """``linear``, ``linear_into`` and ``BoundLinear`` with a w8a8 weight give the format's
    product (the rows on their int8 grids), on the tiles and without them; the weight-only
    product differs."""
    if tiles and not int8_amx.available():
        pytest.skip("no AMX-INT8 here")
    if not tiles:
        monkeypatch.setattr(int8_amx, "available", lambda: False)
    x = torch.randn(M, 128, generator=torch.Generator().manual_seed(M))
    w = w8a8_weight(96, 128, seed=1)
    want = int8_amx.gemm_ref(x, w)
    torch.testing.assert_close(linear(x, w), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear_into(x, w, torch.empty(M, 96)), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(BoundLinear(w)(x), want, rtol=1e-5, atol=1e-5)
    weight_only = Int8Tensor(w.q, w.scale)
    assert (linear(x, weight_only) - want).abs().max() > 1e-3


@pytest.mark.parametrize("tiles", [True, False])
def test_experts_round_rows_and_hidden_on_every_path(tiles, monkeypatch):
    """``experts_sorted`` with w8a8 experts: the AMX call, or the per-expert loop of
    ``linear`` calls without it, against ``int8_amx.moe_ref`` (a few hidden values may land
    one grid step apart: tests/unit/ops/cpu/test_int8_amx.py)."""
    if tiles and not int8_amx.available():
        pytest.skip("no AMX-INT8 here")
    if not tiles:
        monkeypatch.setattr(int8_amx, "available", lambda: False)
    E, D, F_ = 4, 128, 64
    w13, w2 = w8a8_weight(E, 2 * F_, D, seed=2), w8a8_weight(E, D, F_, seed=3)
    slot_counts = [5, 0, 17, 2]
    R = sum(slot_counts)
    g = torch.Generator().manual_seed(4)
    x, weight = torch.randn(R, D, generator=g), torch.rand(R, generator=g)
    got = experts_sorted(x, weight, slot_counts, w13, w2)
    want = int8_amx.moe_ref(x, [0, 2, 3], [5, 17, 2], w13, w2, weight)
    diff = (got - want).abs()
    assert diff.max() < 0.05 * want.abs().max()
    assert (diff > 1e-5 * want.abs().max()).float().mean() < 0.05


@needs_amx
@pytest.mark.parametrize("kind", ["deepseek_tiles", "qwen3_moe"])
def test_amx_engine_close_to_the_format_without_it(checkpoints, kind, monkeypatch):
    """The tiles against the torch rounding of the rows plus the weight-only kernels (measured
    max gap 0.011 and 0.022, mean 0.001 and 0.0025 on these checkpoints)."""
    got = _generate(checkpoints[kind], quantization="w8a8_int8")
    monkeypatch.setattr(int8_amx, "available", lambda: False)
    want = _generate(checkpoints[kind], quantization="w8a8_int8")
    assert max_logprob_gap(got, want) < 0.1


@pytest.mark.parametrize("kind", ["deepseek_tiles", "qwen3_moe"])
def test_close_to_the_int8_weight_oracle(checkpoints, kind):
    """Against fp32 activations on the same int8 weights only the rows' rounding to int8
    differs: prompt log-probabilities move by a bounded amount (measured max 0.02 and 0.07
    on these checkpoints)."""
    want = _generate(checkpoints[f"{kind}-oracle"])
    got = _generate(checkpoints[kind], quantization="w8a8_int8")
    assert max_logprob_gap(got, want) < 0.3


def test_what_is_converted_and_what_stays(checkpoints):
    model, _, _ = load_model(
        checkpoints["deepseek_tiles"], torch.float32, weight_format="w8a8_int8"
    )
    layer = model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_b_proj, attn.kv_b_proj, attn.o_proj, model.lm_head)
    for w in (m.weight for m in linears):
        assert isinstance(w, Int8Weight) and formats.of(w).name == "w8a8_int8"
        assert w.data.weight_format == "w8a8_int8"
    experts = mlp.experts
    assert formats.of(experts.w13_EFD) is formats.get("w8a8_int8")
    assert formats.of(experts.w2_EDF[3]) is formats.get("w8a8_int8")  # slices keep it
    # the absorbed MLA products: bf16 on the AMX tiles, else int8's codes
    assert attn.w_uk_HCN.dtype == (torch.bfloat16 if bf16_amx.available() else torch.int8)
    assert mlp.gate.weight.dtype == torch.float32  # the router stays fp32
    assert model.embed_tokens.weight.dtype == torch.float32
    int8, _, _ = load_model(checkpoints["deepseek_tiles"], torch.float32, weight_format="int8")
    assert formats.of(int8.layers[1].mlp.experts.w13_EFD) is formats.get("int8")
    assert isinstance(int8.layers[1].self_attn.w_uk_HCN, HeadCodes)


def test_config_keeps_fp32_activations():
    cfg = EngineConfig(model="m", quantization="w8a8_int8", device="cpu")
    assert formats.resolve(cfg.quantization, cfg.dtype, cfg.torch_device) == (
        "w8a8_int8",
        torch.float32,
    )
    with pytest.raises(ValueError, match="w8a8_int8"):
        EngineConfig(model="m", quantization="w8a8")


@needs_amx
def test_decode_calls_bind_and_match_the_torch_path(checkpoints, monkeypatch):
    """Decode steps run as the prebound kernel calls (MLA and MoE) and agree with the
    layers' torch paths, which run the same kernels one op at a time."""
    from moeserve.ops.cpu import int8_amx as int8_amx
    from moeserve.ops.cpu.mla_decode import MLADecodeCalls
    from moeserve.ops.cpu.moe_decode import MoEDecodeCalls

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    path = str(checkpoints["deepseek_tiles"])
    llm = LLM(model=path, quantization="w8a8_int8", **ENGINE)
    bound = llm.generate(PROMPTS, params)
    layer = llm.engine.model.layers[1]
    assert isinstance(layer.self_attn._decode_calls, MLADecodeCalls)
    assert isinstance(layer.mlp._decode_calls, MoEDecodeCalls)
    assert isinstance(layer.mlp._decode_calls.experts, int8_amx.BoundMoE)
    monkeypatch.setattr(MLADecodeCalls, "bind", staticmethod(lambda *a: None))
    monkeypatch.setattr(MoEDecodeCalls, "bind", staticmethod(lambda *a: None))
    want = LLM(model=path, quantization="w8a8_int8", **ENGINE).generate(PROMPTS, params)
    for a, b in zip(bound, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            (tx, lx), (ty, ly) = next(iter(x.items())), next(iter(y.items()))
            assert tx == ty and abs(lx.logprob - ly.logprob) < 1e-4
