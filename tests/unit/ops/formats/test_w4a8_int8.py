"""``--quantization w4a8_int8``: int4's group-wise weights and each GEMM's input rows
quantized to int8 per token. Checked:

- each dispatch (``linear``, ``BoundLinear``, ``experts_sorted``) on each path (the AMX
  tiles, int4's integer dots on the int8 grids, the rows rounded in torch) against the
  format's references (``ops/cpu/int4_amx.py``);
- the engine on its kernels against the same format without them (the rows rounded to their
  int8 grids in torch, then int4's weight-only paths): the grids are the same, fp32 sums in
  another order move a few values across a rounding boundary of the next GEMM's grid (as for
  w8a8_int8, ``test_w8a8_int8.py``);
- against the fp32 oracle of the int4 weights (``tests/int8_oracle``): only the activations'
  rounding separates them, a bounded drift; an AWQ checkpoint served in this format too;
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
from moeserve.ops.cpu import bf16_amx, int4_amx
from moeserve.ops.linear import BoundLinear, linear, linear_into
from moeserve.ops.moe import experts_sorted
from moeserve.quant.int4 import Int4Tensor, Int4Weight, quantize_groups
from tests.checkpoints import DEEPSEEK_TILES, build_hf_model, save_hf_checkpoint
from tests.helpers import max_logprob_gap
from tests.int4_checkpoints import write_int4_checkpoint
from tests.int8_oracle import write_int4_oracle

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
ENGINE = dict(dtype="float32", max_model_len=160, progress=False)
# 90 prompt tokens: prefill takes the many-row paths; decode the few-row ones
PROMPTS = [list(range(5, 95)), [3, 17, 4, 200, 9]]
GROUP = 32  # every dimension of the checkpoints below is a multiple
PATHS = ["tiles", "dots", "torch"]


def force(path: str, monkeypatch) -> None:
    """Only ``path`` runs (skipped where it cannot): the tiles, the integer dots, or neither
    (the rows rounded in torch)."""
    if path == "tiles":
        if not int4_amx.available():
            pytest.skip("no AMX-INT8 here")
        monkeypatch.setattr(int4_amx, "FEW_ROWS", 0)
        return
    monkeypatch.setattr(int4_amx, "available", lambda: False)
    if path == "dots" and not int4_amx.dots_available():
        pytest.skip("no integer dots of int4 here")
    if path == "torch":
        monkeypatch.setattr(int4_amx, "_dots_level", lambda rows: None)


def without_kernels(monkeypatch) -> None:
    force("torch", monkeypatch)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("w4a8")
    out = {}
    # deepseek_tiles has every GEMM on the int8 tiles (K % 64, N % 16); qwen3_moe's experts
    # (F 32) take the per-expert fallback
    models = {
        "deepseek_tiles": build_hf_model("deepseek_v3", **DEEPSEEK_TILES),
        "qwen3_moe": build_hf_model("qwen3_moe"),
    }
    for kind, model in models.items():
        src = save_hf_checkpoint(model, root / kind)
        out[kind] = src
        out[f"{kind}-oracle"] = write_int4_oracle(src, root / f"{kind}-oracle", GROUP, False)
    return out


def _generate(path: Path, params: SamplingParams = PARAMS, **kw):
    return LLM(model=str(path), **{**ENGINE, **kw}).generate(PROMPTS, params)


def _w4a8(**kw):
    return dict(quantization="w4a8_int8", int4_group_size=GROUP, int4_symmetric=False, **kw)


def w4a8_weight(*shape: int, seed: int) -> Int4Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) / shape[-1] ** 0.5
    return Int4Tensor(*quantize_groups(w, 64, False), symmetric=False, weight_format="w4a8_int8")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M", [1, 40])
def test_projections_round_their_rows_on_every_path(M, path, monkeypatch):
    """``linear``, ``linear_into`` and ``BoundLinear`` with a w4a8 weight give the format's
    product (the rows on their int8 grids) on each path; int4's weight-only product
    differs."""
    force(path, monkeypatch)
    x = torch.randn(M, 128, generator=torch.Generator().manual_seed(M))
    w = w4a8_weight(96, 128, seed=1)
    want = int4_amx.gemm_ref(x, w)
    # in torch, int4's integer dots may take the rounded rows again (exact: the int8 grid's
    # points are on theirs) and sum in another order
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, w), want, **tol)
    torch.testing.assert_close(linear_into(x, w, torch.empty(M, 96)), want, **tol)
    torch.testing.assert_close(BoundLinear(w)(x), want, **tol)
    weight_only = Int4Tensor(w.q, w.scale, w.zero, symmetric=False)
    assert (linear(x, weight_only) - want).abs().max() > 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_experts_round_rows_and_hidden_on_every_path(path, monkeypatch):
    """``experts_sorted`` with w4a8 experts: one call on the tiles or the dots, or the
    per-expert loop of ``linear`` calls without them, against ``int4_amx.moe_ref`` (a few
    hidden values may land one grid step apart: tests/unit/ops/cpu/test_int4_amx.py)."""
    force(path, monkeypatch)
    E, D, F_ = 4, 128, 64
    w13, w2 = w4a8_weight(E, 2 * F_, D, seed=2), w4a8_weight(E, D, F_, seed=3)
    slot_counts = [5, 0, 17, 2]
    R = sum(slot_counts)
    g = torch.Generator().manual_seed(4)
    x, weight = torch.randn(R, D, generator=g), torch.rand(R, generator=g)
    got = experts_sorted(x, weight, slot_counts, w13, w2)
    want = int4_amx.moe_ref(x, [0, 2, 3], [5, 17, 2], w13, w2, weight)
    diff = (got - want).abs()
    assert diff.max() < 0.05 * want.abs().max()
    assert (diff > 1e-4 * want.abs().max()).float().mean() < 0.05


@pytest.mark.parametrize("kind", ["deepseek_tiles", "qwen3_moe"])
def test_engine_close_to_the_format_without_its_kernels(checkpoints, kind, monkeypatch):
    if not (int4_amx.available() or int4_amx.dots_available()):
        pytest.skip("no w4a8 kernel here")
    got = _generate(checkpoints[kind], **_w4a8())
    without_kernels(monkeypatch)
    want = _generate(checkpoints[kind], **_w4a8())
    assert max_logprob_gap(got, want) < 0.1


@pytest.mark.parametrize("kind", ["deepseek_tiles", "qwen3_moe"])
def test_close_to_the_int4_weight_oracle(checkpoints, kind):
    """Against fp32 activations on the same int4 weights only the rows' rounding to int8
    differs: prompt log-probabilities move by a bounded amount."""
    want = _generate(checkpoints[f"{kind}-oracle"])
    got = _generate(checkpoints[kind], **_w4a8())
    assert max_logprob_gap(got, want) < 0.3


def test_what_is_converted_and_what_stays(checkpoints):
    fmt = formats.configured("w4a8_int8", GROUP, False)
    model, _, _ = load_model(checkpoints["deepseek_tiles"], torch.float32, weight_format=fmt)
    layer = model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    for w in (m.weight for m in (attn.q_b_proj, attn.kv_b_proj, attn.o_proj, model.lm_head)):
        assert isinstance(w, Int4Weight) and formats.of(w).name == "w4a8_int8"
        assert w.group_size == GROUP and not w.symmetric
    assert formats.of(mlp.experts.w13_EFD).name == "w4a8_int8"
    assert formats.of(mlp.experts.w2_EDF[3]).name == "w4a8_int8"  # slices keep it
    # the absorbed MLA products: bf16 on the AMX tiles, else the model dtype
    assert attn.w_uk_HCN.dtype == (torch.bfloat16 if bf16_amx.available() else torch.float32)
    assert mlp.gate.weight.dtype == torch.float32  # the router stays fp32
    assert model.embed_tokens.weight.dtype == torch.float32


def test_config_takes_int4_options():
    cfg = EngineConfig(model="m", quantization="w4a8_int8", int4_group_size=64, device="cpu")
    assert formats.resolve(cfg.quantization, cfg.dtype, cfg.torch_device) == (
        "w4a8_int8",
        torch.float32,
    )
    fmt = formats.configured("w4a8_int8", 64, False)
    assert type(fmt).__name__ == "W4a8Int8Format" and (fmt.group_size, fmt.symmetric) == (64, False)
    assert formats.configured("w4a8_int8") is formats.get("w4a8_int8")
    assert fmt.bytes_per_weight == formats.configured("int4", 64).bytes_per_weight
    with pytest.raises(ValueError, match="int4 and w4a8_int8 only, not int8"):
        EngineConfig(model="m", quantization="int8", int4_group_size=64)


def test_an_awq_checkpoint_serves_in_w4a8(checkpoints, tmp_path):
    """A published 4-bit checkpoint asked for w4a8_int8 keeps its codes and rounds the rows:
    close to its format's own dequantization in fp32, and int4's options of its own."""
    src = write_int4_checkpoint(checkpoints["deepseek_tiles"], tmp_path / "awq", "awq", GROUP)
    want = _generate(src / "oracle")
    llm = LLM(model=str(src), quantization="w4a8_int8", **ENGINE)
    got = llm.generate(PROMPTS, PARAMS)
    assert max_logprob_gap(got, want) < 0.3
    experts = llm.engine.model.layers[1].mlp.experts.w13_EFD
    assert formats.of(experts).name == "w4a8_int8" and experts.group_size == GROUP


@pytest.mark.parametrize("path", ["tiles", "dots"])
def test_decode_calls_bind_and_match_the_torch_path(checkpoints, monkeypatch, path):
    """Decode steps run as the prebound kernel calls (MLA and MoE) and agree with the
    layers' torch paths, which run the same kernels one op at a time."""
    force(path, monkeypatch)
    from moeserve.ops.cpu.mla_decode import MLADecodeCalls
    from moeserve.ops.cpu.moe_decode import MoEDecodeCalls

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    model = str(checkpoints["deepseek_tiles"])
    llm = LLM(model=model, **_w4a8(), **ENGINE)
    bound = llm.generate(PROMPTS, params)
    layer = llm.engine.model.layers[1]
    assert isinstance(layer.self_attn._decode_calls, MLADecodeCalls)
    assert isinstance(layer.mlp._decode_calls, MoEDecodeCalls)
    experts = layer.mlp._decode_calls.experts
    assert isinstance(experts, int4_amx.BoundMoE) and experts.kind == path
    monkeypatch.setattr(MLADecodeCalls, "bind", staticmethod(lambda *a: None))
    monkeypatch.setattr(MoEDecodeCalls, "bind", staticmethod(lambda *a: None))
    want = LLM(model=model, **_w4a8(), **ENGINE).generate(PROMPTS, params)
    for a, b in zip(bound, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            (tx, lx), (ty, ly) = next(iter(x.items())), next(iter(y.items()))
            assert tx == ty and abs(lx.logprob - ly.logprob) < 1e-4
