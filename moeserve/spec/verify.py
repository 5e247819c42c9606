"""Draft sampling and verification with the sampler's processing on both sides.

The target's distribution at the row after draft ``d_j`` and the draft's distribution for
``d_{j+1}`` are both processed as if ``d_1 .. d_j`` were already output tokens: repetition,
frequency and presence penalties and ``min_tokens`` see the same history, and temperature,
min-p, top-k and top-p are the same functions (``layers/sampler.py``). So the rejection rule
(``rejection.py``) compares the two distributions a plain step would sample from, and the
emitted tokens follow the target's exactly.

A seeded sequence takes every uniform from its own generator (``n + 1`` per verification,
one per drafted token), so its tokens do not depend on the rest of the batch.

Shape suffixes: N rows, B sequences, K most drafts, K1 = K + 1, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from moeserve.core import PositionLogprobs, SamplingParams, Sequence
from moeserve.layers.sampler import _logprob_dicts, process_logits, sampling_logits
from moeserve.spec.rejection import greedy_accept_row, inverse_cdf, rejection_sample


@dataclass(frozen=True)
class SeqView:
    """What the sampler's processing reads of a :class:`Sequence`, with extra output tokens
    appended (the drafts before a row, or the tokens just accepted)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None

    @staticmethod
    def of(seq: Sequence, extra: SequenceABC[int] = ()) -> SeqView:
        out = seq.output_token_ids + list(extra) if extra else seq.output_token_ids
        return SeqView(seq.params, seq.prompt_token_ids, out, seq.eos_token_ids, seq.generator)


@dataclass(frozen=True)
class Verified:
    """What one sequence emits from a verification: ``len(token_ids) == num_accepted + 1``."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]
    num_accepted: int


def _uniforms(views: SequenceABC[SeqView], counts: SequenceABC[int]) -> list[list[float]]:
    out = []
    for v, n in zip(views, counts, strict=True):
        u = torch.rand(n, generator=v.generator, dtype=torch.float64) if n else torch.empty(0)
        out.append(u.tolist())
    return out


def sample_drafts(
    logits_NV: torch.Tensor, views: SequenceABC[SeqView]
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft token per row, and the distribution it was drawn from (None for greedy
    rows, which take the argmax). Uses one uniform of the row's generator per random row.

    Logits may be -inf outside a subset (a hot vocabulary): the distribution is then the
    subset's, renormalized. A row left with no finite logit (every hot id masked) drafts token
    0 with probability 1, which rejection sampling handles like any other draft."""
    processed_NV = process_logits(logits_NV.float(), views)
    tokens_N = processed_NV.argmax(dim=-1)
    probs: list[torch.Tensor | None] = [None] * len(views)
    rand = [i for i, v in enumerate(views) if not v.params.greedy]
    if rand:
        idx = torch.tensor(rand, device=logits_NV.device)
        rviews = [views[i] for i in rand]
        l_RV = sampling_logits(processed_NV[idx], rviews)
        dead_R = l_RV.max(dim=-1).values == -math.inf
        if bool(dead_R.any()):
            l_RV[dead_R, 0] = 0.0
        probs_RV = l_RV.softmax(dim=-1)
        u_R = torch.tensor([u for (u,) in _uniforms(rviews, [1] * len(rand))], dtype=torch.float64)
        tokens_N[idx] = inverse_cdf(probs_RV, u_R.to(probs_RV.device))
        for r, i in enumerate(rand):
            probs[i] = probs_RV[r]
    return tokens_N.tolist(), probs


def verify(
    logits_NV: torch.Tensor,
    seqs: SequenceABC[Sequence],
    drafts: SequenceABC[SequenceABC[int]],
    draft_probs: SequenceABC[torch.Tensor | None],
) -> list[Verified]:
    """Accept or reject every sequence's drafts against the target.

    ``logits_NV`` holds ``len(drafts[b]) + 1`` consecutive rows per sequence (target logits
    at the last known token and after each draft). ``draft_probs[b]`` is ``[n_b, V]`` (from
    :func:`sample_drafts`) for a random sequence with drafts, else ignored. Only the
    generators of seeded random sequences advance.
    """
    counts = [len(d) for d in drafts]
    if logits_NV.shape[0] != sum(counts) + len(counts):
        raise ValueError(
            f"expected {sum(counts) + len(counts)} logits rows for drafts of lengths {counts}, "
            f"got {logits_NV.shape[0]}"
        )
    logits_NV = logits_NV.float()
    views = [SeqView.of(s, d[:j]) for s, d in zip(seqs, drafts) for j in range(len(d) + 1)]
    processed_NV = process_logits(logits_NV, views)
    starts = [0]  # each sequence's first row
    for n in counts:
        starts.append(starts[-1] + n + 1)
    emitted: list[list[int]] = [[] for _ in seqs]

    greedy = [b for b in range(len(seqs)) if seqs[b].params.greedy]
    rand = [b for b in range(len(seqs)) if not seqs[b].params.greedy]
    if greedy:
        target = processed_NV.argmax(dim=-1).tolist()
        for b in greedy:
            emitted[b] = greedy_accept_row(list(drafts[b]), target[starts[b] : starts[b + 1]])
    if rand:
        accepted = _accept_random(processed_NV, views, seqs, drafts, draft_probs, starts, rand)
        for b, tokens in zip(rand, accepted, strict=True):
            emitted[b] = tokens
    return _verified(logits_NV, seqs, emitted, starts)


def _accept_random(
    processed_NV: torch.Tensor,
    views: SequenceABC[SeqView],
    seqs: SequenceABC[Sequence],
    drafts: SequenceABC[SequenceABC[int]],
    draft_probs: SequenceABC[torch.Tensor | None],
    starts: list[int],
    rand: list[int],
) -> list[list[int]]:
    """Rejection sampling of the random sequences ``rand`` (indices into ``seqs``): the
    tokens each emits, in ``rand`` order. Takes ``n + 1`` uniforms from each generator."""
    counts = [len(d) for d in drafts]
    R, K, dev = len(rand), max(counts, default=0), processed_NV.device
    draft_RK = torch.tensor(
        [list(drafts[b]) + [0] * (K - counts[b]) for b in rand], dtype=torch.long, device=dev
    ).reshape(R, K)
    num_R = torch.tensor([counts[b] for b in rand], device=dev)
    rows = [starts[b] + j for b in rand for j in range(counts[b] + 1)]
    rviews = [views[i] for i in rows]
    p_NV = sampling_logits(processed_NV[torch.tensor(rows, device=dev)], rviews).softmax(-1)
    # [R, K1] rows of p per sequence, in rand order; padding repeats the last row
    rstarts = [0]
    for b in rand:
        rstarts.append(rstarts[-1] + counts[b] + 1)
    p_idx = torch.tensor(
        [[rstarts[i] + min(j, counts[b]) for j in range(K + 1)] for i, b in enumerate(rand)],
        device=dev,
    )
    p_RK1V = p_NV[p_idx]
    q_RKV = _draft_probs_RKV(seqs, counts, draft_probs, rand, K, p_NV)
    us = _uniforms([SeqView.of(seqs[b]) for b in rand], [counts[b] + 1 for b in rand])
    u_acc = torch.tensor([u[:-1] + [1.0] * (K - len(u) + 1) for u in us], dtype=torch.float64)
    u_fin = torch.tensor([u[-1] for u in us], dtype=torch.float64)
    accepted_R, tokens_RK1 = rejection_sample(
        draft_RK, num_R, q_RKV, p_RK1V, u_acc.reshape(R, K).to(dev), u_fin
    )
    return [toks[: a + 1] for a, toks in zip(accepted_R.tolist(), tokens_RK1.tolist(), strict=True)]


def _draft_probs_RKV(
    seqs: SequenceABC[Sequence],
    counts: list[int],
    draft_probs: SequenceABC[torch.Tensor | None],
    rand: list[int],
    K: int,
    p_NV: torch.Tensor,
) -> torch.Tensor:
    """The random sequences' draft distributions as one ``[R, K, V]`` tensor (ones past a
    sequence's drafts). Raises ValueError for a missing or misshapen ``draft_probs[b]``."""
    V, dev = p_NV.shape[1], p_NV.device
    q_RKV = torch.ones(len(rand), K, V, dtype=p_NV.dtype, device=dev)
    for i, b in enumerate(rand):
        if counts[b]:
            q = draft_probs[b]
            if q is None or tuple(q.shape) != (counts[b], V):
                raise ValueError(
                    f"sequence {seqs[b].seq_id}: expected draft probabilities "
                    f"[{counts[b]}, {V}], got {None if q is None else tuple(q.shape)}"
                )
            q_RKV[i, : counts[b]] = q.to(dev)
    return q_RKV


def _verified(
    logits_NV: torch.Tensor,
    seqs: SequenceABC[Sequence],
    emitted: list[list[int]],
    starts: list[int],
) -> list[Verified]:
    """Each sequence's emitted tokens with their logprobs (from the unprocessed logits of the
    rows they were sampled at), for the sequences that asked for logprobs."""
    B, dev = len(seqs), logits_NV.device
    acc = [len(e) - 1 for e in emitted]
    want_lp = [b for b in range(B) if seqs[b].params.logprobs is not None]
    lp_rows = {b: [None] * (acc[b] + 1) for b in range(B)}
    if want_lp:
        rows = [starts[b] + j for b in want_lp for j in range(acc[b] + 1)]
        chosen = torch.tensor([t for b in want_lp for t in emitted[b]])
        nums = [seqs[b].params.logprobs or 0 for b in want_lp for _ in range(acc[b] + 1)]
        logprobs_RV = torch.log_softmax(logits_NV[torch.tensor(rows, device=dev)], dim=-1)
        entries = iter(_logprob_dicts(logprobs_RV, chosen.to(dev), nums))
        for b in want_lp:
            lp_rows[b] = [next(entries) for _ in range(acc[b] + 1)]
    return [Verified(emitted[b], lp_rows[b], acc[b]) for b in range(B)]
