"""Next-token sampling for a batch of sequences, with vLLM V1 semantics.

One call turns the last-position logits of every sequence into one token each:

    raw logits ──► logprobs (log_softmax of the RAW logits, when ``params.logprobs`` is set)
        │
        ▼  process_logits: repetition penalty (prompt + output tokens), frequency / presence
        │  penalties (output tokens), min_tokens (EOS and stop ids masked to -inf)
        ├─► greedy rows: argmax
        ▼  sampling_logits: temperature, min-p, top-k, top-p (removed tokens become -inf)
    softmax ──► inverse CDF: first token whose float64 cumulative probability exceeds u * total,
                u ~ U[0, 1) drawn from the row's generator (or the global RNG)

A row whose sequence owns a ``generator`` takes its one uniform from that generator alone, so a
seeded sequence gives the same tokens whatever else shares its batch. Inverse CDF rather than
vLLM's exponential race (``argmax(probs / q)``, ``q ~ Exp(1)``): both draw exactly from
``probs``, but the race needs V random numbers per row and CPU generators are serial (256 x 129k
exponentials take ~0.7 s on 2 cores; the float64 cumsum ~0.16 s, and it parallelizes).

Order: min-p, then top-k and top-p, as vLLM V1 applies them (min-p's threshold is relative to
the most likely token, which top-k/top-p always keep; top-p's nucleus is taken over what
min-p left).

Every stage is vectorized across rows and skipped when no row needs it. The ``reference_*``
functions and :func:`sample_reference` do the same per row in plain torch: they are the test
oracle. Top-k and top-p remove tokens by value: every token tied with the last kept one stays.

Shape suffixes: B rows of the batch, R random-sampling rows, S a subset of rows, V vocabulary,
C top-p candidates, T prompt positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from moeserve.core import Logprob, PositionLogprobs, SamplingParams, Sequence

# Top-p first looks for its nucleus among this many most likely tokens; rows whose nucleus is
# wider retry with 16x as many, up to the whole vocabulary.
TOP_P_CANDIDATES = 1024
_PROMPT_LOGPROBS_CHUNK = 512


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row; ``logprobs[b]`` is None unless ``params.logprobs`` is set."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


class Sampler:
    """Samples the next token of every sequence of a batch; stateless, safe to share."""

    def __call__(self, logits_BV: torch.Tensor, seqs: SequenceABC[Sequence]) -> SamplerOutput:
        """Row ``b`` of ``logits_BV`` gives the next-token logits of ``seqs[b]``.

        Does not modify ``logits_BV`` or the sequences; only the sequences' generators advance
        (one float64 uniform per seeded random row).
        """
        if logits_BV.dim() != 2 or logits_BV.shape[0] != len(seqs):
            raise ValueError(
                f"expected logits of shape [len(seqs)={len(seqs)}, vocab], "
                f"got {tuple(logits_BV.shape)}"
            )
        if not seqs:
            return SamplerOutput([], [])
        logits_BV = logits_BV.float()
        processed_BV = process_logits(logits_BV, seqs)

        random_rows = [b for b, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            token_ids_B = greedy_ids(processed_BV)
        elif len(random_rows) == len(seqs):
            token_ids_B = _sample_random(processed_BV, seqs)
        else:
            token_ids_B = greedy_ids(processed_BV)
            idx = torch.tensor(random_rows, device=logits_BV.device)
            token_ids_B[idx] = _sample_random(processed_BV[idx], [seqs[b] for b in random_rows])

        return SamplerOutput(
            token_ids=token_ids_B.tolist(), logprobs=_sample_logprobs(logits_BV, token_ids_B, seqs)
        )


# --------------------------------------------------------------------------------------------
# Fast path


def greedy_ids(logits_BV: torch.Tensor) -> torch.Tensor:
    """``logits_BV.argmax(dim=-1)`` (int64): each row's first largest value, or its first nan.
    fp32 rows on the CPU go through NumPy's argmax, which gives the same index: torch's took
    47 us for one row of 32000, NumPy's 2.4."""
    if logits_BV.device.type == "cpu" and logits_BV.dtype == torch.float32:
        return torch.from_numpy(logits_BV.detach().numpy().argmax(axis=-1))
    return logits_BV.argmax(dim=-1)


def process_logits(logits_BV: torch.Tensor, seqs: SequenceABC[Sequence]) -> torch.Tensor:
    """Penalties and min_tokens, applied to a copy; returns ``logits_BV`` itself if no row needs
    them. Work is proportional to the number of distinct tokens seen, not to ``B * V``."""
    vocab, dev = logits_BV.shape[1], logits_BV.device
    rep = [b for b, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    freq_pres = [
        b
        for b, s in enumerate(seqs)
        if s.output_token_ids and (s.params.frequency_penalty or s.params.presence_penalty)
    ]
    min_tok = [(b, ids) for b, s in enumerate(seqs) if (ids := _min_tokens_blocked(s, vocab))]
    if not (rep or freq_pres or min_tok):
        return logits_BV
    out_BV = logits_BV.clone()

    if rep:
        rows, toks, _ = _unique_tokens(
            [torch.tensor(seqs[b].prompt_token_ids + seqs[b].output_token_ids) for b in rep],
            rep,
            vocab,
            dev,
        )
        penalty = torch.tensor([s.params.repetition_penalty for s in seqs], device=dev)[rows]
        vals = out_BV[rows, toks]
        out_BV[rows, toks] = torch.where(vals > 0, vals / penalty, vals * penalty)

    if freq_pres:
        rows, toks, counts = _unique_tokens(
            [torch.tensor(seqs[b].output_token_ids) for b in freq_pres], freq_pres, vocab, dev
        )
        freq = torch.tensor([s.params.frequency_penalty for s in seqs], device=dev)[rows]
        pres = torch.tensor([s.params.presence_penalty for s in seqs], device=dev)[rows]
        out_BV[rows, toks] -= freq * counts + pres

    if min_tok:
        rows = torch.tensor([b for b, ids in min_tok for _ in ids], device=dev)
        toks = torch.tensor([t for _, ids in min_tok for t in ids], device=dev)
        out_BV[rows, toks] = -math.inf
    return out_BV


def sampling_logits(logits_RV: torch.Tensor, seqs: SequenceABC[Sequence]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (vLLM V1's order), as a new tensor with removed
    tokens at -inf.

    ``softmax`` of the result is the distribution a random row samples from. Greedy params are
    not expected here (temperature 0 would divide by zero).
    """
    params = [s.params for s in seqs]
    vocab, dev = logits_RV.shape[1], logits_RV.device
    temps = [p.temperature for p in params]
    if all(t == 1.0 for t in temps):
        l_RV = logits_RV.clone()
    else:
        l_RV = logits_RV / torch.tensor(temps, device=dev).unsqueeze(1)

    min_p = [r for r, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        log_min_p_S1 = torch.tensor([math.log(params[r].min_p) for r in min_p], device=dev)
        log_min_p_S1 = log_min_p_S1.unsqueeze(1)

        def mask_min_p(l_SV: torch.Tensor) -> None:
            # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p)
            thresh_S1 = l_SV.max(dim=-1, keepdim=True).values + log_min_p_S1
            l_SV.masked_fill_(l_SV < thresh_S1, -math.inf)

        _update_rows(l_RV, min_p, mask_min_p)

    top_k = [r for r, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k:
        k_S1 = torch.tensor([params[r].top_k for r in top_k], device=dev).unsqueeze(1)

        def mask_top_k(l_SV: torch.Tensor) -> None:
            kth_S1 = l_SV.topk(int(k_S1.max()), dim=-1).values.gather(1, k_S1 - 1)
            l_SV.masked_fill_(l_SV < kth_S1, -math.inf)

        _update_rows(l_RV, top_k, mask_top_k)

    top_p = [r for r, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        p_S1 = torch.tensor([params[r].top_p for r in top_p], device=dev).unsqueeze(1)

        def mask_top_p(l_SV: torch.Tensor) -> None:
            l_SV.masked_fill_(l_SV < _top_p_threshold(l_SV, p_S1), -math.inf)

        _update_rows(l_RV, top_p, mask_top_p)

    return l_RV


def compute_prompt_logprobs(
    logits_TV: torch.Tensor, target_ids_T: torch.Tensor | SequenceABC[int], num_top: int
) -> list[PositionLogprobs]:
    """Row ``t`` of ``logits_TV`` predicts ``target_ids_T[t]``; returns, per row, the target's
    Logprob (rank = 1 + number of strictly more likely tokens) and the ``num_top`` most likely
    tokens (ranks 1..num_top). Raw distribution, no penalties or temperature. Works in chunks of
    rows so the extra memory stays bounded for long prompts."""
    target_T = torch.as_tensor(target_ids_T, dtype=torch.long, device=logits_TV.device)
    if target_T.shape[0] != logits_TV.shape[0]:
        raise ValueError(
            f"expected one target per logits row, got {target_T.shape[0]} targets for "
            f"{logits_TV.shape[0]} rows"
        )
    result: list[PositionLogprobs] = []
    for start in range(0, logits_TV.shape[0], _PROMPT_LOGPROBS_CHUNK):
        stop = start + _PROMPT_LOGPROBS_CHUNK
        logprobs = torch.log_softmax(logits_TV[start:stop].float(), dim=-1)
        chunk = target_T[start:stop]
        result += _logprob_dicts(logprobs, chunk, [num_top] * chunk.shape[0])
    return result


def _sample_random(logits_RV: torch.Tensor, seqs: SequenceABC[Sequence]) -> torch.Tensor:
    probs_RV = sampling_logits(logits_RV, seqs).softmax(dim=-1)
    u_R = torch.empty(len(seqs), dtype=torch.float64)
    free = [r for r, s in enumerate(seqs) if s.generator is None]
    if len(free) == len(seqs):
        u_R.uniform_()
    elif free:
        u_R[torch.tensor(free)] = torch.rand(len(free), dtype=torch.float64)
    for r, s in enumerate(seqs):
        if s.generator is not None:
            u_R[r] = torch.rand((), generator=s.generator, dtype=torch.float64)
    return _inverse_cdf(probs_RV, u_R.to(probs_RV.device))


def _inverse_cdf(probs_RV: torch.Tensor, u_R: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds ``u * total``.

    Zero-probability tokens never win (the cdf does not rise there); if rounding pushes the
    target past the end, the row falls back to its most likely token."""
    cdf_RV = probs_RV.cumsum(dim=-1, dtype=torch.float64)
    target_R1 = (u_R * cdf_RV[:, -1]).unsqueeze(1)
    tokens_R = torch.searchsorted(cdf_RV, target_R1, right=True).squeeze(1)
    tokens_R.clamp_max_(probs_RV.shape[1] - 1)
    bad_R = probs_RV.gather(1, tokens_R.unsqueeze(1)).squeeze(1) == 0
    if bool(bad_R.any()):
        tokens_R[bad_R] = probs_RV[bad_R].argmax(dim=-1)
    return tokens_R


def _top_p_threshold(l_SV: torch.Tensor, p_S1: torch.Tensor) -> torch.Tensor:
    """Per row, the logit of the last token of the smallest most-likely set whose probability
    is >= top_p. Searched among the top C logits; rows where all C would be kept retry with a
    larger C (up to V, a full sort)."""
    vocab = l_SV.shape[1]
    probs_SV = l_SV.softmax(dim=-1)
    thresh_S1 = torch.empty(l_SV.shape[0], 1, device=l_SV.device)
    todo_S = torch.arange(l_SV.shape[0], device=l_SV.device)
    n_cand = min(TOP_P_CANDIDATES, vocab)
    while todo_S.numel():
        first = n_cand == min(TOP_P_CANDIDATES, vocab)
        l_sub, probs_sub = (l_SV, probs_SV) if first else (l_SV[todo_S], probs_SV[todo_S])
        vals_SC, ids_SC = l_sub.topk(n_cand, dim=-1)
        cum_SC = probs_sub.gather(1, ids_SC).cumsum(dim=-1)
        # keep position i iff the mass before it is < top_p: (cum < top_p).sum() + 1 positions
        n_keep_S = (cum_SC < p_S1[todo_S]).sum(dim=-1)
        done_S = (n_keep_S < n_cand) | (n_cand == vocab)
        last_S1 = n_keep_S.clamp_max(n_cand - 1).unsqueeze(1)
        thresh_S1[todo_S[done_S]] = vals_SC.gather(1, last_S1)[done_S]
        todo_S = todo_S[~done_S]
        n_cand = min(n_cand * 16, vocab)
    return thresh_S1


def _update_rows(
    x_RV: torch.Tensor, rows: list[int], fn_inplace: Callable[[torch.Tensor], None]
) -> None:
    """Apply ``fn_inplace`` to rows ``rows`` of ``x_RV`` (all rows: no gather / scatter)."""
    if len(rows) == x_RV.shape[0]:
        fn_inplace(x_RV)
        return
    idx = torch.tensor(rows, device=x_RV.device)
    sub_SV = x_RV[idx]
    fn_inplace(sub_SV)
    x_RV[idx] = sub_SV


def _sample_logprobs(
    logits_BV: torch.Tensor, token_ids_B: torch.Tensor, seqs: SequenceABC[Sequence]
) -> list[PositionLogprobs | None]:
    rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[PositionLogprobs | None] = [None] * len(seqs)
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits_BV.device)
    logprobs = torch.log_softmax(logits_BV[idx], dim=-1)
    nums = [seqs[b].params.logprobs or 0 for b in rows]
    for b, d in zip(rows, _logprob_dicts(logprobs, token_ids_B[idx], nums), strict=True):
        out[b] = d
    return out


def _logprob_dicts(
    logprobs_NV: torch.Tensor, chosen_N: torch.Tensor, num_top: list[int]
) -> list[PositionLogprobs]:
    """{chosen: Logprob(rank = 1 + #strictly greater), then top-n alternatives with ranks 1..n}.

    A chosen token that is also among the top-n keeps its own rank (they differ only on ties).
    """
    chosen_lp = logprobs_NV.gather(1, chosen_N.unsqueeze(1))
    ranks = ((logprobs_NV > chosen_lp).sum(dim=-1) + 1).tolist()
    n_max = min(max(num_top), logprobs_NV.shape[1])
    top_lp, top_ids = ([], [])
    if n_max:
        top = logprobs_NV.topk(n_max, dim=-1)
        top_lp, top_ids = top.values.tolist(), top.indices.tolist()
    result = []
    for n, (tok, lp, rank) in enumerate(
        zip(chosen_N.tolist(), chosen_lp.squeeze(1).tolist(), ranks, strict=True)
    ):
        d = {tok: Logprob(lp, rank)}
        for j in range(min(num_top[n], n_max)):
            d.setdefault(top_ids[n][j], Logprob(top_lp[n][j], j + 1))
        result.append(d)
    return result


def _unique_tokens(
    ids_per_row: list[torch.Tensor], rows: list[int], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs with their counts, on ``device``; tokens outside the
    vocabulary dropped. Built on the CPU, where the token lists live."""
    lengths = torch.tensor([t.numel() for t in ids_per_row])
    toks = torch.cat(ids_per_row).long()
    row_ids = torch.repeat_interleave(torch.tensor(rows), lengths)
    keep = (toks >= 0) & (toks < vocab)
    keys, counts = torch.unique(row_ids[keep] * vocab + toks[keep], return_counts=True)
    keys, counts = keys.to(device), counts.to(device)
    return keys // vocab, keys % vocab, counts.float()


def _min_tokens_blocked(seq: Sequence, vocab: int) -> list[int]:
    """Token ids masked for ``seq`` at this step: EOS (unless ignore_eos) and stop ids while
    fewer than ``min_tokens`` tokens were generated. Not under structured output: its grammar
    decides when the answer may end (a complete one allows nothing but EOS)."""
    p = seq.params
    if len(seq.output_token_ids) >= p.min_tokens or p.guided_decoding is not None:
        return []
    ids = set(p.stop_token_ids)
    if not p.ignore_eos:
        ids |= seq.eos_token_ids
    return sorted(t for t in ids if 0 <= t < vocab)


# --------------------------------------------------------------------------------------------
# Per-row reference (test oracle)


def reference_process_logits(logits_V: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Penalties and min_tokens for one row, token by token."""
    out = logits_V.float().clone()
    p = seq.params
    for tok in set(seq.prompt_token_ids) | set(seq.output_token_ids):
        if out[tok] > 0:
            out[tok] = out[tok] / p.repetition_penalty
        else:
            out[tok] = out[tok] * p.repetition_penalty
    for tok in set(seq.output_token_ids):
        count = seq.output_token_ids.count(tok)
        out[tok] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if len(seq.output_token_ids) < p.min_tokens and p.guided_decoding is None:
        blocked = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
        for tok in blocked:
            out[tok] = -math.inf
    return out


def reference_sampling_logits(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p for one row; removed tokens at -inf."""
    l = logits_V.float() / params.temperature
    if params.min_p > 0.0:
        probs = l.softmax(dim=-1)
        l = l.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    if params.top_k > 0:
        kth = l.sort(descending=True).values[min(params.top_k, l.numel()) - 1]
        l = l.masked_fill(l < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_l = l.sort(descending=True).values
        cum = sorted_l.softmax(dim=-1).cumsum(dim=-1)
        n_keep = min(int((cum < params.top_p).sum()) + 1, l.numel())
        l = l.masked_fill(l < sorted_l[n_keep - 1], -math.inf)
    return l


def sample_reference(logits_V: torch.Tensor, seq: Sequence) -> int:
    """One row through the whole pipeline; draws from ``seq.generator`` (or the global RNG)
    exactly as :class:`Sampler` does, so seeded rows must agree token for token."""
    l = reference_process_logits(logits_V, seq)
    if seq.params.greedy:
        return int(l.argmax())
    probs = reference_sampling_logits(l, seq.params).softmax(dim=-1)
    u = float(torch.rand((), generator=seq.generator, dtype=torch.float64))
    cdf = probs.double().cumsum(dim=0)
    for tok in range(probs.numel()):
        if cdf[tok] > u * cdf[-1]:
            return tok
    return int(probs.argmax())
