"""Int4 weights under tensor and expert parallelism: quantized at load (each rank quantizes
its own shard, a row-parallel shard's groups inside its columns) and read from AWQ / GPTQ
checkpoints (each rank cuts its shard from the packed tensors, between groups). Both match
one fp32 process on the weights dequantized the same way; w4a8_int8 (the same weights, rows
rounded to int8) stays within its rounding of it. A shard that would cut a group, and
GPTQ's act-order under a column split, are clear errors at load."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams
from tests.checkpoints import build_hf_model, save_hf_checkpoint
from tests.helpers import max_logprob_gap
from tests.int4_checkpoints import write_int4_checkpoint
from tests.int8_oracle import assert_int4_outputs, write_int4_oracle

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=0)
ENGINE = dict(dtype="float32", progress=False, max_model_len=160, max_num_batched_tokens=40)
PROMPTS = [list(range(5, 75)), [9, 8, 7, 300, 12], list(range(100, 130))]
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "ep2-dp2": dict(data_parallel_size=2, enable_expert_parallel=True),
}
# wide enough that every tensor-parallel shard of a row-parallel layer holds whole groups of
# 32: o_proj 4 x 32 = 128 columns, the FFNs 128 and 64
WIDE = dict(v_head_dim=32, intermediate_size=128, moe_intermediate_size=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("int4tp") / "wide"
    return save_hf_checkpoint(build_hf_model("deepseek_v3", **WIDE), path)


def _run(path, **kw):
    llm = LLM(str(path), max_num_seqs=2, **ENGINE, **kw)
    try:
        return llm.generate(PROMPTS, PARAMS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_int4_layout_matches_its_fp32_oracle(checkpoint, tmp_path, layout):
    tp = LAYOUTS[layout].get("tensor_parallel_size", 1)
    oracle = write_int4_oracle(checkpoint, tmp_path / "oracle", 32, symmetric=False, tp=tp)
    want = _run(oracle)
    got = _run(
        checkpoint, quantization="int4", int4_group_size=32, int4_symmetric=False, **LAYOUTS[layout]
    )
    assert_int4_outputs(got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_w4a8_layout_close_to_its_int4_oracle(checkpoint, tmp_path, layout):
    """w4a8_int8 holds int4's weights, cut as int4's are; each rank rounds the rows it
    multiplies to int8 (a row-parallel shard of a row its own grid), so against the fp32
    oracle of the int4 weights only that rounding remains: the one-process bound
    (tests/unit/ops/formats/test_w4a8_int8.py)."""
    tp = LAYOUTS[layout].get("tensor_parallel_size", 1)
    oracle = write_int4_oracle(checkpoint, tmp_path / "oracle", 32, symmetric=False, tp=tp)
    want = _run(oracle)
    kw = dict(quantization="w4a8_int8", int4_group_size=32, int4_symmetric=False)
    got = _run(checkpoint, **kw, **LAYOUTS[layout])
    assert max_logprob_gap(got, want) < 0.3


@pytest.mark.parametrize(
    "method, kw, layout",
    [("awq", {}, "tp2"), ("awq", {}, "ep2-dp2"), ("gptq", dict(act_order=True), "ep2-dp2")],
)
def test_4bit_checkpoints_under_each_layout(checkpoint, tmp_path, method, kw, layout):
    src = write_int4_checkpoint(checkpoint, tmp_path / method, method, 32, **kw)
    want = _run(src / "oracle")
    assert_int4_outputs(_run(src, **LAYOUTS[layout]), want)


def test_shards_that_would_cut_groups_fail_the_load(tmp_path):
    """The default test model's o_proj has 96 columns: 48 per rank under TP 2 cuts a group
    of 32. And act-order GPTQ cannot split columns at all."""
    narrow = save_hf_checkpoint(build_hf_model("deepseek_v3"), tmp_path / "narrow")
    awq = write_int4_checkpoint(narrow, tmp_path / "awq", "awq", 32)
    with pytest.raises(RuntimeError, match=r"o_proj.weight: .* does not divide the 48 columns"):
        _run(awq, tensor_parallel_size=2)
    wide = save_hf_checkpoint(build_hf_model("deepseek_v3", **WIDE), tmp_path / "wide")
    gptq = write_int4_checkpoint(wide, tmp_path / "gptq", "gptq", 32, act_order=True)
    with pytest.raises(RuntimeError, match="act-order .* cannot be split along its input"):
        _run(gptq, tensor_parallel_size=2)
