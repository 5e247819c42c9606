"""A prefix-cache hit gives the numbers a cold run gives (issue 20, part 3).

What made a hit differ, both fixed: (1) a prompt whose cached prefix left one token to compute
ran that token through the decode path (MLA's absorbed attention over the paged cache) where a
cold run computes it in the prefill (``ScheduledSeq.is_decode``); (2) blocks holding generated
tokens, computed by the decode path, were reused by later prompts (the prefix cache now holds
prompt blocks only). The two paths round differently: in fp32 by ~1e-6 in the logprobs, with
bf16 weights (what ``dtype="auto"`` runs on a CPU with AMX) by ~1e-2, enough to change greedy
outputs of the demo model. What remains in fp32 is rounding that follows the batch's shape (a
row's sums depend on how many rows share a kernel call, cached or not), below 1e-5 here.
"""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.demo import tiny_model_path
from moeserve.ops.cpu import bf16_amx
from moeserve.platform import cpu_flags
from tests.checkpoints import VOCAB, build_hf_model, save_hf_checkpoint

BS = 16  # EngineConfig's default block size
TOL = 1e-5
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)


def shared_prefix_prompts(seed: int, vocab: int = VOCAB) -> list[list[int]]:
    """36 prompts: 9 prefixes (around block boundaries) x 4 suffixes. A second run hits whole
    blocks of each, and leaves one token to compute for 9 of them (17, 33, 49, 65, 81 tokens)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=g).tolist()

    prompts = []
    for n in (5, 15, 16, 17, 31, 32, 48, 70, 100):
        prefix = ids(n)
        prompts += [prefix + ids(m) for m in (1, 2, 16, 33)]
    return prompts


def make_llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(model=str(path), progress=False, max_model_len=256, **kw)


def run(llm: LLM, prompts, params: SamplingParams = GREEDY) -> list[tuple[list[int], list]]:
    """(greedy tokens, their logprobs) per prompt."""
    outs = []
    for o in llm.generate(prompts, params):
        c = o.outputs[0]
        outs.append((c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return outs


def assert_same(got, want, tol: float = TOL) -> float:
    """Identical greedy tokens, logprobs within ``tol``; returns the largest logprob gap (over
    each output up to where it first differs)."""
    gap, changed = 0.0, []
    for i, ((tg, lg), (tw, lw)) in enumerate(zip(got, want, strict=True)):
        same = next((k for k, (a, b) in enumerate(zip(tg, tw)) if a != b), len(tg))
        gap = max([gap] + [abs(a - b) for a, b in zip(lg[:same], lw[:same])])
        if tg != tw:
            changed.append(f"prompt {i} from token {same}")
    assert not changed, f"greedy outputs changed: {changed}; logprobs moved by {gap:.3g}"
    assert gap <= tol, f"logprobs moved by {gap:.3g} (> {tol})"
    return gap


def one_token_left(prompts) -> int:
    return sum(1 for p in prompts if len(p) > BS and len(p) % BS == 1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The demo model and two test checkpoints (DeepSeek-V3 with v_head_dim != qk_nope, and
    Qwen3-MoE's GQA attention)."""
    root = tmp_path_factory.mktemp("parity")
    return {
        "demo": tiny_model_path(),
        "deepseek_v3": save_hf_checkpoint(build_hf_model("deepseek_v3"), root / "ds"),
        "qwen3_moe": save_hf_checkpoint(build_hf_model("qwen3_moe"), root / "qwen"),
    }


@pytest.mark.parametrize("name", ["demo", "deepseek_v3", "qwen3_moe"])
def test_warm_matches_cold_in_mixed_batches(models, name):
    """fp32: every prompt cold (no cache, in batches), then on an engine with the cache half
    of them, all of them (warm and cold requests in the same steps) and all again (all warm),
    each pass in chunked, mixed batches of prefills and decodes."""
    prompts = shared_prefix_prompts(seed=1)
    assert len(prompts) >= 32 and one_token_left(prompts) == 9
    batching = dict(max_num_seqs=12, max_num_batched_tokens=64)
    cold = run(make_llm(models[name], enable_prefix_caching=False, **batching), prompts)
    llm = make_llm(models[name], **batching)
    run(llm, prompts[::2])
    mixed = run(llm, prompts)
    warm = run(llm, prompts[::-1])[::-1]
    bm = llm.engine.scheduler.block_manager
    assert bm.prefix_cache_hits > len(prompts) * BS  # most prompts hit whole blocks
    assert_same(mixed, cold)
    assert_same(warm, cold)


def bf16_llm(path, **kw) -> LLM:
    """bf16 weights with fp32 activations: ``dtype="auto"`` on a CPU with AMX (the AMX
    kernels where they run, the weights widened per call elsewhere). One sequence at a time,
    so that cold and warm runs batch alike and only the cache differs."""
    return make_llm(path, quantization="bf16", max_num_seqs=1, kv_cache_memory_gb=0.05, **kw)


def _bf16_tolerance() -> float:
    """Where the AMX bf16 kernel runs, a row's sums do not depend on the rows beside it:
    TOL. Elsewhere the bf16 weights are widened per call and torch's fp32 GEMM blocks by
    the row count, so one token computed alone rounds apart from the same token in a long
    prefill: 4.9e-4 measured on an AVX2-only EPYC; the decode path's ~1e-2 stays caught."""
    return TOL if bf16_amx._FLAGS <= cpu_flags() else 2e-3


def test_one_token_left_after_a_hit_runs_the_prefill_path():
    """A prompt of k blocks + 1 token hits k blocks; its last token must take the prefill
    path, as in the cold run (the decode path moved these logprobs by ~1e-2 and changed a
    greedy output)."""
    prompts = [p for p in shared_prefix_prompts(seed=2) if len(p) % BS == 1 and len(p) > BS]
    path = tiny_model_path()
    cold_llm = bf16_llm(path, enable_prefix_caching=False)
    cold = [run(cold_llm, [p])[0] for p in prompts]
    llm = bf16_llm(path)
    for p in prompts:
        run(llm, [p])
    bm = llm.engine.scheduler.block_manager
    hits = bm.prefix_cache_hits
    warm = [run(llm, [p])[0] for p in prompts]
    assert bm.prefix_cache_hits - hits == sum(len(p) - 1 for p in prompts)
    assert_same(warm, cold, tol=_bf16_tolerance())


# A prompt prefilled in two parts (its hit, then 17 tokens) against one prefill of it: the MoE
# layers' kernels take their rows per expert, and the 17-row call rounds some rows apart from
# the 145-row one (measured here with bf16 AMX: equal through the first MoE layer's input,
# 7e-5 in the next layer's latent rows). That reaches the logprobs as 1e-6 in attention
# outputs, which the bf16 rounding of W_UV's input flips now and then: 1.6e-4 measured with
# the AVX-512 decode attention, 0 with its AVX2 form. The decode path's ~1e-2 stays caught.
SPLIT_PREFILL_TOL = 2e-3


def test_next_turn_repeating_an_answer_matches_cold():
    """Turn 2 repeats turn 1's prompt and answer: it hits the prompt's blocks and recomputes
    the answer's (decode-computed blocks are not cached), as a cold run computes them."""
    path = tiny_model_path()
    g = torch.Generator().manual_seed(3)
    first = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (20, 37, 64, 90, 130)]
    llm = bf16_llm(path)
    answers = [run(llm, [p])[0][0] for p in first]
    second = [p + a + [7, 8, 9] for p, a in zip(first, answers)]
    warm = [run(llm, [p])[0] for p in second]
    cold_llm = bf16_llm(path, enable_prefix_caching=False)
    cold = [run(cold_llm, [p])[0] for p in second]
    assert_same(warm, cold, tol=SPLIT_PREFILL_TOL)
    bm = llm.engine.scheduler.block_manager
    assert bm.prefix_cache_hits == sum(len(p) // BS * BS for p in first)
