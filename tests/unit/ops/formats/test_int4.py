"""``--quantization int4``: group-wise 4-bit storage (``quant/int4.py``), weights quantized as
fp32, bf16 and FP8 checkpoints stream in, and engines whose outputs match an fp32 engine on
the dequantized weights (``tests/int8_oracle.py``), on every kernel path."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve import LLM, SamplingParams
from moeserve.layers.moe import FusedExperts, Router
from moeserve.models.loader import load_model
from moeserve.ops import formats
from moeserve.ops.cpu import int4, int4_amx
from moeserve.quant.head_codes import HeadCodes
from moeserve.quant.int4 import (
    Int4Tensor,
    Int4Weight,
    dequantize_groups,
    pack_nibbles,
    quantize_groups,
    unpack_nibbles,
)
from tests.checkpoints import DEEPSEEK_TILES, build_hf_model, save_hf_checkpoint
from tests.int8_oracle import assert_int4_outputs, write_int4_oracle
from tests.unit.ops.formats.test_int8_loading import _fp8_copy

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
ENGINE = dict(dtype="float32", max_model_len=160, progress=False)
PROMPTS = [list(range(5, 95)), [3, 17, 4, 200, 9]]  # prefill's many-row path, then decode


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4")
    out = {
        kind: save_hf_checkpoint(build_hf_model(kind), root / kind)
        for kind in ("deepseek_v3", "qwen3_moe")
    }
    # every GEMM and the experts in shapes AMX's tiles take (K % 64, N % 16)
    tiles = build_hf_model("deepseek_v3", **DEEPSEEK_TILES)
    out["deepseek_tiles"] = save_hf_checkpoint(tiles, root / "deepseek_tiles")
    return out


def _generate(path: Path, **kw):
    return LLM(model=str(path), **{**ENGINE, **kw}).generate(PROMPTS, PARAMS)


# -- storage --------------------------------------------------------------------------------


def test_the_layout_packs_two_runs_of_16_columns_per_16_bytes():
    u = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    q = pack_nibbles(u)
    assert q.shape == (3, 32)
    assert int(q[1, 5]) == int(u[1, 5]) | int(u[1, 21]) << 4  # run 0: columns 5 and 21
    assert int(q[2, 16 + 3]) == int(u[2, 32 + 3]) | int(u[2, 48 + 3]) << 4  # run 1
    assert torch.equal(unpack_nibbles(q), u)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_groups_round_to_nearest_within_half_a_step(group, symmetric):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(5, 256, generator=g) * torch.rand(5, 1, generator=g) * 3
    w[0, :group] = 0  # an all-zero group
    q, scale, zero = quantize_groups(w, group, symmetric)
    assert q.shape == (5, 128) and scale.shape == zero.shape == (5, 256 // group)
    back = dequantize_groups(q, scale, zero)
    step = scale.repeat_interleave(group, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(back[0, :group], torch.zeros(group))
    if symmetric:
        assert (zero == 8).all()
    else:  # the group's range spans the 16 codes, zero representable
        assert int(zero.max()) <= 15
        assert ((unpack_nibbles(q) == 0) | (unpack_nibbles(q) == 15)).any()


def test_bad_weights_and_group_sizes_are_clear():
    with pytest.raises(ValueError, match="does not divide the 96 columns"):
        quantize_groups(torch.randn(2, 96), 64)
    with pytest.raises(ValueError, match="must be one of 32, 64, 128"):
        quantize_groups(torch.randn(2, 96), 48)
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_groups(torch.tensor([[float("nan")] * 32]), 32)
    with pytest.raises(ValueError, match="needs a float tensor"):
        quantize_groups(torch.zeros(2, 32, dtype=torch.int8), 32)
    with pytest.raises(ValueError, match="--quantization int4: int4 group size 128"):
        formats.get("int4").make_weight(torch.nn.Parameter(torch.empty(4, 96)))
    with pytest.raises(IndexError, match="leading dims only"):
        Int4Weight((4, 64), 32)[:, :32]


def test_views_quantize_the_rows_they_are_given():
    w = Int4Weight((3, 4, 64), 32, symmetric=False)
    rows = torch.randn(2, 64)
    w[1][1:3].copy_(rows)
    q, scale, zero = quantize_groups(rows, 32, symmetric=False)
    assert torch.equal(w.q[1, 1:3], q) and torch.equal(w.scale[1, 1:3], scale)
    assert torch.equal(w.zero[1, 1:3], zero)
    assert [p.shape for p in w.parts()] == [(3, 4, 32), (3, 4, 2), (3, 4, 2)]
    taken = w[1].take(torch.tensor([2, 1]))
    assert isinstance(taken, Int4Tensor) and torch.equal(taken.q[0], q[1])
    held = sum(p.numel() * p.element_size() for p in w.parameters())
    assert held == 3 * 4 * (32 + 2 * 4 + 2)  # codes, fp32 scales, uint8 zero points


def test_the_format_in_the_registry():
    fmt = formats.get("int4")
    assert "int4" in formats.QUANTIZATIONS and fmt.group_size == 128 and fmt.symmetric
    assert fmt.weight_bytes((16, 256)) == 16 * (128 + 2 * 5)
    small = formats.configured("int4", 32, False)
    assert small.group_size == 32 and not small.symmetric and small.name == "int4"
    w = small.make_weight(torch.nn.Parameter(torch.empty(8, 64)))
    assert formats.of(w) is fmt  # a weight computes the same whatever it was quantized with
    with pytest.raises(ValueError, match="apply to the int4 weights of quantization int4 and w4a8"):
        formats.configured("int8", 64)
    with pytest.raises(ValueError, match="must be one of"):
        formats.check_options("int4", 16, True)


# -- loading and engines --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_engine_matches_fp32_on_dequantized_weights(checkpoints, kind, symmetric, tmp_path):
    oracle = write_int4_oracle(checkpoints[kind], tmp_path / "oracle", 32, symmetric)
    want = _generate(oracle)
    got = _generate(
        checkpoints[kind], quantization="int4", int4_group_size=32, int4_symmetric=symmetric
    )
    assert_int4_outputs(got, want)


@pytest.mark.parametrize("path", ["avx2", "avx2-idot", "avx512", "reference", "tiles"])
def test_other_paths_match_too(checkpoints, tmp_path, monkeypatch, path):
    """The AVX2 kernels (FMA and integer dots) on a CPU that would pick AVX-512, AVX-512F's
    lookups on one that would pick VNNI's integer dots, the torch references without
    kernels (all without AMX's tiles); and the tiles taking the prefill's products (from
    ``int4_amx.ROWS16_MIN`` rows, the experts from ``MOE_ROWS16_MIN`` an expert: the rows
    rounded to 16 bits, as the integer dots round them)."""
    if path == "tiles":
        if not int4_amx.available():
            pytest.skip("no AMX-INT8 here")
        oracle = write_int4_oracle(checkpoints["deepseek_tiles"], tmp_path / "oracle", 32)
        calls = []
        gemm, moe = int4_amx.gemm_nt, int4_amx.moe_experts
        monkeypatch.setattr(int4_amx, "gemm_nt", lambda *a, **k: calls.append(1) or gemm(*a, **k))
        monkeypatch.setattr(
            int4_amx, "moe_experts", lambda *a, **k: calls.append(2) or moe(*a, **k)
        )
        got = _generate(checkpoints["deepseek_tiles"], quantization="int4", int4_group_size=32)
        assert 1 in calls and 2 in calls  # projections and experts of the prefill
        assert_int4_outputs(got, _generate(oracle), rounds=True)
        return
    oracle = write_int4_oracle(checkpoints["deepseek_v3"], tmp_path / "oracle", 32)
    want = _generate(oracle)
    monkeypatch.setattr(int4_amx, "available", lambda: False)
    if path.startswith("avx2"):
        monkeypatch.setattr(int4, "wide", lambda: False)
        if path == "avx2":
            monkeypatch.setenv("MOESERVE_INT4_IDOT", "0")
    elif path == "avx512":
        if not (int4.available() and int4.wide()):
            pytest.skip("no AVX-512F here")
        monkeypatch.setenv("MOESERVE_INT4_IDOT", "0")
    else:
        monkeypatch.setattr(int4, "available", lambda: False)
    got = _generate(checkpoints["deepseek_v3"], quantization="int4", int4_group_size=32)
    assert_int4_outputs(got, want, rounds=path == "avx2-idot")


def test_what_is_quantized_and_what_stays(checkpoints):
    fmt = formats.configured("int4", 32)
    model, _, _ = load_model(checkpoints["deepseek_v3"], torch.float32, weight_format=fmt)
    layer = model.layers[1]
    for w in (
        layer.self_attn.q_b_proj.weight,
        layer.self_attn.kv_b_proj.weight,
        layer.self_attn.o_proj.weight,
        layer.mlp.experts.w13_EFD,
        layer.mlp.experts.w2_EDF,
        model.layers[0].mlp.gate_up_proj.weight,
        model.lm_head.weight,
    ):
        assert isinstance(w, Int4Weight) and w.group_size == 32
    for m in model.modules():  # routers, embeddings, norms keep fp32
        if isinstance(m, Router):
            assert m.weight.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.float32
    attn = layer.self_attn  # the absorbed MLA weights: kv_b_proj's codes, exactly
    kv_b = attn.kv_b_proj.weight.dequantize().view(attn.H, attn.N + attn.V, attn.C)
    assert isinstance(attn.w_uk_HCN, HeadCodes) and isinstance(attn.w_uv_HVC, HeadCodes)
    assert torch.equal(attn.w_uk_HCN.dequantize(), kv_b[:, : attn.N].transpose(1, 2))
    assert torch.equal(attn.w_uv_HVC.dequantize(), kv_b[:, attn.N :])
    fp32, _, _ = load_model(checkpoints["deepseek_v3"], torch.float32)
    int8, _, _ = load_model(checkpoints["deepseek_v3"], torch.float32, weight_format="int8")
    nbytes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in (model, int8)]
    quantized = [  # the bytes of the weights the formats convert
        sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "layers" in n)
        for m in (model, int8, fp32)
    ]
    assert nbytes[0] < nbytes[1] and quantized[0] < 0.2 * quantized[2]


@pytest.mark.parametrize("source", ["bfloat16", "fp8"])
def test_groups_are_quantized_as_they_load(checkpoints, tmp_path, source):
    """A weight holds quantize_groups of the tensor as loaded (after FP8 dequantization):
    the gate/up halves and each expert's rows on their own."""
    src = checkpoints["deepseek_v3"]
    if source == "fp8":
        tensors = _fp8_copy(src, tmp_path / "fp8")
        src = tmp_path / "fp8"
    else:
        path = tmp_path / source
        shutil.copytree(src, path)
        raw = load_file(str(path / "model.safetensors"))
        tensors = {k: v.to(torch.bfloat16) for k, v in raw.items()}
        save_file(tensors, str(path / "model.safetensors"))
        src = path
    fmt = formats.configured("int4", 32, False)
    model, _, _ = load_model(src, torch.float32, weight_format=fmt, progress=False)
    experts: FusedExperts = model.layers[1].mlp.experts
    up = tensors["model.layers.1.mlp.experts.3.up_proj.weight"].float()
    q, scale, zero = quantize_groups(up, 32, False)
    f = experts.ffn
    assert torch.equal(experts.w13_EFD.q[3, f:], q)
    assert torch.equal(experts.w13_EFD.scale[3, f:], scale)
    assert torch.equal(experts.w13_EFD.zero[3, f:], zero)


def test_a_group_that_does_not_divide_a_dimension_fails_the_load(checkpoints):
    """q_b_proj reads the 32 columns of the q latent: group 64 cannot split them."""
    match = r"q_b_proj.weight: --quantization int4: int4 group size 64 does not divide the 32"
    with pytest.raises(ValueError, match=match):
        LLM(
            model=str(checkpoints["deepseek_v3"]),
            quantization="int4",
            int4_group_size=64,
            **ENGINE,
        )


def test_int4_on_a_cpu_without_avx2_is_refused_at_load(checkpoints, monkeypatch):
    from moeserve.ops.formats import int4 as int4_format

    monkeypatch.setattr(int4_format, "cpu_flags", lambda: frozenset({"sse4_2"}))
    with pytest.raises(ValueError, match="int4 needs a CPU with AVX2 and FMA"):
        load_model(checkpoints["deepseek_v3"], torch.float32, weight_format="int4")


def test_mtp_drafts_keep_int4_greedy_outputs(tmp_path):
    """The MTP layer's projections are int4 too; drafts verified by the int4 model leave its
    greedy outputs as they are."""
    from tests.mtp_checkpoint import save_mtp_checkpoint

    ckpt = save_mtp_checkpoint(tmp_path / "mtp")[2]
    kw = dict(quantization="int4", int4_group_size=32, **ENGINE)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = LLM(model=str(ckpt), **kw).generate(PROMPTS, params)
    llm = LLM(model=str(ckpt), speculative_num_tokens=2, **kw)
    got = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert isinstance(llm.engine.model.mtp_layers[0].eh_proj.weight, Int4Weight)
    assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0
