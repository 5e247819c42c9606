"""Reusable test helpers (no fixtures here; conftest-free on purpose)."""

from __future__ import annotations

from pathlib import Path

import torch


def copy_demo_tokenizer(dst_dir: str | Path) -> Path:
    """Put the demo tokenizer (vocab 512) into a checkpoint directory a test made.

    Writes tokenizer.json, tokenizer_config.json (with the DeepSeek-V3-style chat template)
    and generation_config.json (bos 0, eos 1), replacing any that are there.
    """
    from moeserve.demo import write_demo_tokenizer

    return write_demo_tokenizer(dst_dir)


def demo_tokenizer_variant(
    dst_dir: str | Path, drop: tuple[str, ...] = (), add: tuple[str, ...] = ()
):
    """The demo tokenizer written to ``dst_dir`` and loaded, with the added tokens ``drop``
    removed (their text is then spelled with ordinary tokens) and ``add`` appended as added
    tokens that decode as text (Qwen3's ``<tool_call>``, say). The BPE part is unchanged."""
    import json

    from moeserve.tokenizer import Tokenizer

    d = copy_demo_tokenizer(dst_dir)
    spec = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    added = [t for t in spec["added_tokens"] if t["content"] not in drop]
    next_id = max(t["id"] for t in spec["added_tokens"]) + 1
    for i, text in enumerate(add):
        added.append(
            {"id": next_id + i, "content": text, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": False}
        )  # fmt: skip
    spec["added_tokens"] = added
    (d / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return Tokenizer.from_dir(d)


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


def sorted_reference(x_RD, weight_R, slot_counts, w13_SFD, w2_SDF):
    """Rows sorted by slot (``slot_counts[s]`` rows for slot ``s``) through their slot's gated
    FFN, each times its weight: ``ops/moe.moe_reference`` (the one expert reference) with every
    row a token of one choice, its slot at its weight."""
    import torch

    from moeserve.ops.moe import moe_reference

    slots_R = torch.repeat_interleave(torch.arange(len(slot_counts)), torch.tensor(slot_counts))
    return moe_reference(x_RD, w13_SFD, w2_SDF, weight_R[:, None], slots_R[:, None])


def fill_routing(buffers, E: int, generator: torch.Generator) -> tuple[list, list, int]:
    """A random decode step's rows sorted by expert in MoEBuffers (``ops/cpu/bound.py``):
    ``buffers.R`` choices among ``E`` experts, the sorted groups in ``meta``, random rows and
    routing weights; returns ``(experts, counts, groups)`` (experts with no rows left out)."""
    R, D = buffers.x_sorted.shape
    ids = torch.randint(0, E, (R,), generator=generator).sort().values
    counts_E = torch.bincount(ids, minlength=E).tolist()
    experts = [e for e in range(E) if counts_E[e]]
    counts = [counts_E[e] for e in experts]
    starts = torch.tensor(counts).cumsum(0) - torch.tensor(counts)
    G = len(experts)
    buffers.meta[:, :G] = torch.tensor([experts, starts.tolist(), counts])
    buffers.x_sorted.copy_(torch.randn(R, D, generator=generator))
    buffers.weight.copy_(torch.rand(R, generator=generator))
    return experts, counts, G


def sort_by_expert(ids_TK: torch.Tensor, E: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """A routing's choices sorted by expert, as the MoE kernels take them: ``(order, experts,
    counts)`` with ``order`` the flat choices' permutation (row ``order // K`` of the tokens)
    and the experts with rows, in order, and their rows."""
    flat = ids_TK.reshape(-1)
    order = flat.argsort(stable=True)
    counts_E = torch.bincount(flat, minlength=E).tolist()
    experts = [e for e in range(E) if counts_E[e]]
    return order, experts, [counts_E[e] for e in experts]
