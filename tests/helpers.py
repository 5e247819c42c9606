"""Reusable test helpers (no fixtures here; conftest-free on purpose)."""

from __future__ import annotations

from pathlib import Path


def copy_demo_tokenizer(dst_dir: str | Path) -> Path:
    """Put the demo tokenizer (vocab 512) into a checkpoint directory a test made.

    Writes tokenizer.json, tokenizer_config.json (with the DeepSeek-V3-style chat template)
    and generation_config.json (bos 0, eos 1), replacing any that are there.
    """
    from moeserve.demo import write_demo_tokenizer

    return write_demo_tokenizer(dst_dir)


def max_logprob_gap(got, want) -> float:
    """The largest |difference| of the prompt tokens' log-probabilities between two lists of
    outputs of the same prompts (``prompt_logprobs=0``; the first position has none)."""
    gap = 0.0
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            (tx, lx), (ty, ly) = next(iter(x.items())), next(iter(y.items()))
            assert tx == ty
            gap = max(gap, abs(lx.logprob - ly.logprob))
    return gap
