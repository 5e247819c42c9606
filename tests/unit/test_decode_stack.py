"""The decode stack (``models/decode_stack.py``) against the layers it runs in place of: the
same numbers bit for bit, for every weight format whose calls it binds and for a model whose
sublayers it runs as modules, and it steps aside where a hook or the rows say so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.models.decode_stack import DecodeStack, _rows, _run
from moeserve.ops.cpu import chain
from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu.chain import NEGATIVE, NONZERO, BuiltChain, ChainError, PythonChain
from moeserve.ops.cpu.mla_decode import MLADecodeCalls
from moeserve.ops.cpu.moe_decode import MoEDecodeCalls
from moeserve.ops.cpu.residual import ResidualRows
from tests.checkpoints import build_hf_model, save_hf_checkpoint

pytestmark = pytest.mark.skipif(not fp32_kernels.available(), reason="no C kernels here")

# no prefix caching: a second run of the same prompts would prefill fewer rows, which rounds
# apart from the first (test_prefix_cache_parity.py)
ENGINE = dict(
    dtype="float32", max_model_len=160, max_num_seqs=4, progress=False, enable_prefix_caching=False
)
PROMPTS = [list(range(5, 45)), [3, 17, 4, 200, 9], [7, 8] * 6]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stack")
    paths = {}
    for kind in ("deepseek_v3", "qwen2_moe"):
        model = build_hf_model(kind, seed=3)
        with torch.no_grad():  # norms of their own (they start as ones), so a swap shows
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
        paths[kind] = save_hf_checkpoint(model, root / kind)
    return paths


@pytest.fixture
def stack_runs(monkeypatch) -> list[bool]:
    """Whether the decode stack ran the layers (True) or stepped aside (False), for each step
    of decodes only (the stack steps aside from the others: checked here too)."""
    runs: list[bool] = []
    call = DecodeStack.__call__

    def counted(self, positions_T, h_TD, meta):
        out = call(self, positions_T, h_TD, meta)
        if meta.num_decodes == h_TD.shape[0]:
            runs.append(out is not None)
        else:
            assert out is None
        return out

    monkeypatch.setattr(DecodeStack, "__call__", counted)
    return runs


def _logprobs(outputs) -> list:
    """Every request's tokens with their top logprobs, exactly."""
    return [
        [(t, sorted((k, v.logprob) for k, v in lp.items())) for t, lp in
         zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
        for o in outputs
    ]  # fmt: skip


def _generate(llm: LLM, stack: bool) -> list:
    llm.engine.model.use_decode_stack(stack)
    return _logprobs(llm.generate(PROMPTS, PARAMS))


@pytest.mark.parametrize(
    "quantization",
    [None, "int8", "int4", "bf16"],
)
def test_the_stack_gives_the_layers_numbers(checkpoints, stack_runs, quantization):
    """Batches of 3 and fewer decodes (the requests finish together, so 3 throughout) through
    the stack equal the layer-by-layer run bit for bit; the stack ran every decode step and
    bound the MLA and MoE calls of every MoE layer."""
    kw = {} if quantization is None else {"quantization": quantization}
    if quantization == "int4":
        kw["int4_group_size"] = 32
    llm = LLM(model=str(checkpoints["deepseek_v3"]), **ENGINE, **kw)
    want = _generate(llm, False)
    assert not stack_runs
    got = _generate(llm, True)
    assert got == want
    assert len(stack_runs) == PARAMS.max_tokens - 1 and all(stack_runs)
    for layer in llm.engine.model.layers[1:]:
        assert isinstance(layer.self_attn.decode_calls(), MLADecodeCalls)
        assert isinstance(layer.mlp.whole_decode_calls(), MoEDecodeCalls)
        assert layer.mlp.decode_calls().bound_rows()[0] == len(PROMPTS)
    llm.shutdown()


@pytest.mark.parametrize("built", [True, False])
def test_the_calls_in_c_and_from_python_agree(checkpoints, stack_runs, built, monkeypatch):
    """The step's calls as chains made in C (ops/cpu/chain.c) or, without that library, one
    by one from Python: the layers' numbers either way. int8: every layer's calls chain
    (layer 0's dense MLP too), one chain in all."""
    if not built:
        monkeypatch.setattr(chain, "_library", lambda: None)
    elif not chain.available():
        pytest.skip("no chain library (libffi) here")
    llm = LLM(model=str(checkpoints["deepseek_v3"]), quantization="int8", **ENGINE)
    want = _generate(llm, False)
    assert _generate(llm, True) == want and all(stack_runs)
    parts = llm.engine.model._stack._parts
    kind = BuiltChain if built else PythonChain
    assert [type(p) for p in parts] == [kind]
    llm.shutdown()


def test_sublayers_without_calls_run_as_modules(checkpoints, stack_runs):
    """Qwen2-MoE (GQA attention, softmax routing, a gated shared expert): no calls bind, so
    the stack runs every sublayer as its module between its residual calls; the same
    numbers."""
    llm = LLM(model=str(checkpoints["qwen2_moe"]), **ENGINE)
    want = _generate(llm, False)
    got = _generate(llm, True)
    assert got == want and stack_runs and all(stack_runs)
    llm.shutdown()


def test_hooks_and_switched_off_calls(checkpoints, stack_runs):
    """A hook on a module the stack skips sends the step through the layers; calls switched
    off on one MoE block run that block as its module inside the stack, so a hook on its gate
    sees every decode step."""
    llm = LLM(model=str(checkpoints["deepseek_v3"]), **ENGINE)
    model = llm.engine.model
    want = _generate(llm, True)
    seen: list[int] = []
    handle = model.layers[1].post_attention_layernorm.register_forward_hook(
        lambda m, args, out: seen.append(out.shape[0])
    )
    stack_runs.clear()
    assert _generate(llm, True) == want
    handle.remove()
    assert stack_runs and not any(stack_runs)  # stepped aside while hooked
    decode_rows = [n for n in seen if n == len(PROMPTS)]
    assert len(decode_rows) == PARAMS.max_tokens - 1

    stack_runs.clear()
    block = model.layers[2].mlp
    block.use_decode_calls(False)
    routed: list[int] = []
    handle = block.gate.register_forward_hook(lambda m, args, out: routed.append(1))
    got = _generate(llm, True)
    handle.remove()
    assert stack_runs and all(stack_runs)
    assert len(routed) == PARAMS.max_tokens  # the prefill and every decode step
    # the module path routes in torch, the calls in C: the same choices, close weights
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in want]
    llm.shutdown()


def test_weights_moved_between_steps_are_bound_again(checkpoints, stack_runs, monkeypatch):
    """Weights moved after steps through the stack (``p.data`` replaced with new values, as
    the huge-page move does): its guard fails, the layers bind again, and the next steps
    read the new weights (the layers' numbers with them); between moves the guard holds and
    the program is kept."""
    llm = LLM(model=str(checkpoints["deepseek_v3"]), **ENGINE)
    model = llm.engine.model
    want_layers = _generate(llm, False)
    before = _generate(llm, True)  # from here on the same stack: generate without toggling
    stack = model._stack
    assert stack._guard.holds() and len(stack._guard.tensors) > 20
    made = []
    make = stack._make
    monkeypatch.setattr(stack, "_make", lambda r: made.append(1) or make(r))
    stack_runs.clear()
    assert _logprobs(llm.generate(PROMPTS, PARAMS)) == before == want_layers
    # the prefill (as modules) prepared the MoE calls for its rows: made again once, then
    # the guard held for the other decode steps
    assert len(made) == 1 and len(stack_runs) == PARAMS.max_tokens - 1
    program = stack._parts
    moved = [
        model.layers[1].post_attention_layernorm.weight,
        model.layers[1].self_attn.o_proj.weight,
        model.layers[0].mlp.down_proj.weight,  # the dense layer's calls
        model.layers[2].mlp.experts.w13_EFD,
    ]
    for p in moved:
        p.data = p.data * 1.5
    assert not stack._guard.holds()
    got = _logprobs(llm.generate(PROMPTS, PARAMS))
    assert model._stack is stack and stack._parts is not program and all(stack_runs)
    assert stack._guard.holds()
    assert got == _generate(llm, False) and got != before
    llm.shutdown()


def test_more_rows_than_the_norm_kernel_takes_step_aside(checkpoints, stack_runs, monkeypatch):
    llm = LLM(model=str(checkpoints["deepseek_v3"]), **ENGINE)
    monkeypatch.setattr(fp32_kernels, "MAX_ROWS", len(PROMPTS) - 1)
    want = _generate(llm, False)
    assert _generate(llm, True) == want
    assert stack_runs and not any(stack_runs)
    llm.shutdown()


def test_a_sublayer_output_of_the_wrong_shape_is_an_error():
    rows = ResidualRows(2, 8)
    with pytest.raises(ValueError, match="a sublayer returned"):
        _rows(torch.zeros(2, 3), rows)
    y = torch.ones(8, 2, dtype=torch.float64).t()  # other dtype, strided: converted
    assert _rows(y, rows).is_contiguous() and _rows(y, rows).dtype == torch.float32


def test_a_failed_call_raises_as_the_layers_calls_do():
    class Failing:
        def __init__(self, check):
            self.check = check

        def run(self, *registers):
            raise ChainError(3, "MoE sort" if self.check == NEGATIVE else "MLA W_UK", self.check)

    with pytest.raises(RuntimeError, match="MoE sort: an expert id outside"):
        _run(Failing(NEGATIVE), ())
    with pytest.raises(MemoryError, match="MLA W_UK: out of memory"):
        _run(Failing(NONZERO), ())
