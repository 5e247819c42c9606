"""How far a prefix-cache hit moves the outputs from a cold run (issue 20, part 3).

Three cases, each a cold run (prefix caching off) against a warm one on the same checkpoint,
greedy, the first ``--new-tokens`` tokens' logprobs compared (the logprob of the cold run's
token, up to where the greedy outputs first differ):

    mixed     36 prompts (9 shared prefixes x 4 suffixes, around block boundaries), cold in
              one batch; warm: half of them, then all (warm and cold requests in the same
              steps), then all again, in chunked batches of prefills and decodes
    one-left  the prompts of k blocks + 1 token, one at a time: the hit leaves one token
    next-turn turn 1 (those prompts, 40-token answers), then its prompt + answer + 3 tokens,
              one at a time: blocks turn 1's answer filled are in turn 2's prompt (reused
              before the fix, recomputed now)

The unit test (``tests/unit/test_prefix_cache_parity.py``) asserts the demo model's figures;
this prints them for any checkpoint and weight format:

    python benchmarks/prefix_cache_parity.py [--model DIR] [--quantization bf16]
        [--cases mixed,one-left,next-turn]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.demo import tiny_model_path  # noqa: E402
from tests.unit.test_prefix_cache_parity import BS, shared_prefix_prompts  # noqa: E402


def outputs(llm: LLM, prompts, params: SamplingParams) -> list[tuple[list[int], list[dict]]]:
    return [
        (
            o.outputs[0].token_ids,
            [{t: p.logprob for t, p in d.items()} for d in o.outputs[0].logprobs],
        )
        for o in llm.generate(prompts, params)
    ]


def compare(warm, cold) -> tuple[float, list[int]]:
    """(largest gap in the cold tokens' logprobs before a divergence, where outputs diverge)."""
    gap, diverged = 0.0, []
    for (tw, lw), (tc, lc) in zip(warm, cold, strict=True):
        for k, (a, b) in enumerate(zip(tw, tc)):
            if b in lw[k]:
                gap = max(gap, abs(lw[k][b] - lc[k][b]))
            if a != b:
                diverged.append(k)
                break
    return gap, diverged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo)")
    ap.add_argument("--quantization", default=None, help="e.g. bf16 (default: fp32 weights)")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--cases", default="mixed,one-left,next-turn")
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    path = args.model or str(tiny_model_path())
    vocab = 512
    config = Path(path) / "config.json"
    if config.is_file():
        vocab = json.loads(config.read_text())["vocab_size"]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, logprobs=20, ignore_eos=True)
    kw = dict(dtype="float32", quantization=args.quantization, progress=False, max_model_len=256)
    batching = dict(max_num_seqs=12, max_num_batched_tokens=64, kv_cache_memory_gb=0.5)
    one = dict(max_num_seqs=1, kv_cache_memory_gb=0.5)

    results = {}
    if "mixed" in cases:
        ps = shared_prefix_prompts(1, vocab)
        cold = outputs(LLM(model=path, enable_prefix_caching=False, **kw, **batching), ps, params)
        llm = LLM(model=path, **kw, **batching)
        outputs(llm, ps[::2], params)
        results["mixed (warm + cold)"] = compare(outputs(llm, ps, params), cold)
        results["mixed (all warm)"] = compare(outputs(llm, ps[::-1], params)[::-1], cold)
    if cases & {"one-left", "next-turn"}:
        left = [p for p in shared_prefix_prompts(2, vocab) if len(p) > BS and len(p) % BS == 1]
        cold_llm = LLM(model=path, enable_prefix_caching=False, **kw, **one)
        llm = LLM(model=path, **kw, **one)
        answer = SamplingParams(max_tokens=40, temperature=0, logprobs=0, ignore_eos=True)
        first = [outputs(llm, [p], answer)[0] for p in left]
    if "one-left" in cases:
        cold = [outputs(cold_llm, [p], params)[0] for p in left]
        results["one-left"] = compare([outputs(llm, [p], params)[0] for p in left], cold)
    if "next-turn" in cases:
        turn2 = [p + t + [7, 8, 9] for p, (t, _) in zip(left, first)]
        warm = [outputs(llm, [p], params)[0] for p in turn2]
        results["next-turn"] = compare(warm, [outputs(cold_llm, [p], params)[0] for p in turn2])

    print(f"{path}, quantization={args.quantization}, {args.new_tokens} tokens")
    print(f"{'case':22s} {'max |d logprob|':>16s}  greedy outputs diverging (at token)")
    for name, (gap, diverged) in results.items():
        print(f"{name:22s} {gap:16.3g}  {len(diverged)} {diverged}")


if __name__ == "__main__":
    main()
