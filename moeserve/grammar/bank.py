"""The matchers of the rank that samples (a replica's leader): one per constrained
sequence, kept as long as the sequence lives.

Shape legend: B rows sampled in a step, N rows verified (speculative decoding), V the
model's vocabulary, W = ceil(V / 32) bitmask words.

A matcher follows its sequence's output tokens lazily: before each mask it consumes the
outputs it has not seen (the tokens sampled or accepted since, or all of them after the
sequence was re-queued elsewhere, elastic EP), so it never needs to be told what the
scheduler did. The masks of a step do not depend on its logits, so the runner starts them
before the forward pass (:meth:`start`): llguidance computes them on a worker thread
(without the GIL) while the model runs, and :meth:`PendingMask.apply` waits for them only
when the logits are there. With speculative drafts, the mask of the row after draft ``j`` is
the matcher's after ``d_1 .. d_j``; llguidance consumes the drafts, computes the masks and
rolls them back, so a rejected draft leaves nothing behind::

    step      catch up on new outputs -> bitmask_BW (llguidance, in parallel, during the
              forward pass) -> logits
    drafts    catch up -> bitmask_NW for [last token, after d_1, ..., after d_k] -> logits

A thinking budget is a count beside the matcher (``budget.py``): a row whose section is
full allows only ``</think>``, where its grammar allows it (not inside a UTF-8 character).
A grammar that is complete allows only EOS, so the sequence finishes with "stop"; a request
without a tokenizer cannot be constrained (ValueError naming why).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance as llg
import torch

from moeserve.core import Sequence
from moeserve.grammar.bitmask import apply_bitmask
from moeserve.grammar.budget import ThinkingCount
from moeserve.grammar.compile import compile_for, think_tokens
from moeserve.guided import GuidedDecodingParams
from moeserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class PendingMask:
    """The masks of one step's sampled rows, being computed (:meth:`GrammarBank.start`)."""

    def __init__(
        self,
        rows: list[int],
        mask_RW: torch.Tensor,
        done: Future | None,
        forced: SequenceABC[tuple[int, int]] = (),
    ) -> None:
        self.rows, self.mask_RW, self._done, self._forced = rows, mask_RW, done, forced

    def apply(self, logits_BV: torch.Tensor) -> None:
        """Wait for the masks, then hold the rows of ``logits_BV`` to them, in place."""
        if self._done is not None:
            self._done.result()
        _force(self.mask_RW, self._forced)
        _apply(logits_BV, self.rows, self.mask_RW)


class _State:
    def __init__(self, matcher: llg.LLMatcher, count: ThinkingCount | None) -> None:
        self.matcher = matcher
        self.count = count  # the thinking budget's, when the request has one
        self.consumed = 0  # output tokens the matcher has taken

    def forced(self) -> int | None:
        return self.count.forced() if self.count is not None else None

    def forced_after_drafts(self, drafts: list[int]) -> list[int | None]:
        if self.count is None:
            return [None] * (len(drafts) + 1)
        return self.count.forced_after_drafts(drafts)


class GrammarBank:
    """Per-sequence matchers and the masks they give (see the module's doc)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._executor: llg.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None  # computes a step's masks meanwhile
        self._states: weakref.WeakKeyDictionary[Sequence, _State] = weakref.WeakKeyDictionary()

    def check(self, params: GuidedDecodingParams, vocab: int) -> None:
        """Raise ValueError (a GrammarError: what is wrong) when ``params`` do not compile,
        or this engine has no tokenizer to hold a request to them."""
        compile_for(params, self.tokenizer, vocab)

    @staticmethod
    def constrained(seqs: SequenceABC[Sequence]) -> list[int]:
        """The indexes of the sequences with structured output."""
        return [b for b, s in enumerate(seqs) if s.params.guided_decoding is not None]

    def start(
        self, seqs: SequenceABC[Sequence], vocab: int, background: bool = True
    ) -> PendingMask | None:
        """Start the masks of the rows that sample for ``seqs`` (row ``b`` for ``seqs[b]``)
        over ``vocab`` ids; None when none is constrained. ``background``: on the worker
        thread (the caller runs the forward pass meanwhile)."""
        rows = self.constrained(seqs)
        if not rows:
            return None
        mask_RW = _all_allowed(len(rows), vocab)
        states = [self._state(seqs[b], vocab) for b in rows]
        matchers = [(state.matcher, i) for i, state in enumerate(states)]
        forced = [(i, t) for i, state in enumerate(states) if (t := state.forced()) is not None]
        if not background:
            _fill(self._exec(), matchers, mask_RW)
            return PendingMask(rows, mask_RW, None, forced)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        done = self._thread.submit(_fill, self._exec(), matchers, mask_RW)
        return PendingMask(rows, mask_RW, done, forced)

    def mask(self, logits_BV: torch.Tensor, seqs: SequenceABC[Sequence]) -> None:
        """Hold each constrained row of ``logits_BV`` (row ``b`` for ``seqs[b]``) to its
        grammar, in place (:meth:`start` and apply at once)."""
        pending = self.start(seqs, logits_BV.shape[1], background=False)
        if pending is not None:
            pending.apply(logits_BV)

    def mask_drafts(
        self,
        logits_NV: torch.Tensor,
        seqs: SequenceABC[Sequence],
        drafts: SequenceABC[SequenceABC[int]],
    ) -> None:
        """Hold verification rows to their grammars, in place: sequence ``i`` owns
        ``len(drafts[i]) + 1`` consecutive rows, in order (its last token's, then each
        draft's)."""
        first, start = [], 0
        for d in drafts:
            first.append(start)
            start += len(d) + 1
        todo = self.constrained(seqs)
        if not todo:
            return
        V = logits_NV.shape[1]
        rows = [first[i] + j for i in todo for j in range(len(drafts[i]) + 1)]
        mask_NW = _all_allowed(len(rows), V)
        with_drafts, without, forced, at = [], [], [], 0
        for i in todo:
            state = self._state(seqs[i], V)
            if drafts[i]:
                with_drafts.append((state.matcher, at, list(drafts[i])))
            else:
                without.append((state.matcher, at))
            for j, t in enumerate(state.forced_after_drafts(list(drafts[i]))):
                if t is not None:
                    forced.append((at + j, t))
            at += len(drafts[i]) + 1
        if with_drafts:
            _fill(self._exec(), with_drafts, mask_NW, drafts=True)
        if without:
            _fill(self._exec(), without, mask_NW)
        _force(mask_NW, forced)
        _apply(logits_NV, rows, mask_NW)

    def _exec(self) -> llg.LLExecutor:
        if self._executor is None:
            self._executor = llg.LLExecutor()
        return self._executor

    def _state(self, seq: Sequence, vocab: int) -> _State:
        """``seq``'s matcher, caught up with its outputs (made at its first use)."""
        state = self._states.get(seq)
        if state is None:
            params = seq.params.guided_decoding
            tok, grammar = compile_for(params, self.tokenizer, vocab)
            count = None
            if params.thinking and params.thinking_budget is not None:
                start, end = think_tokens(self.tokenizer, tok)  # compile_for checked them
                count = ThinkingCount.of(params.thinking, params.thinking_budget, start, end)
            state = self._states[seq] = _State(llg.LLMatcher(tok, grammar), count)
        new = seq.output_token_ids[state.consumed :]
        if new:
            state.consumed += len(new)
            if state.count is not None:
                state.count.feed(new)
            if not state.matcher.is_error() and not state.matcher.consume_tokens(new):
                # the outputs broke the grammar (not through a mask of ours): end the
                # sequence at once (the matcher then allows only EOS)
                logger.error(
                    "structured output: request %s left its grammar: %s",
                    seq.request_id,
                    state.matcher.get_error(),
                )
        return state


def _apply(logits_NV: torch.Tensor, rows: list[int], mask_RW: torch.Tensor) -> None:
    """Hold rows ``rows`` of ``logits_NV`` to the masks ``mask_RW`` (one per row), in place."""
    if len(rows) == logits_NV.shape[0]:
        apply_bitmask(logits_NV, mask_RW.to(logits_NV.device))
        return
    index = torch.tensor(rows, device=logits_NV.device)
    part = logits_NV.index_select(0, index)
    apply_bitmask(part, mask_RW.to(part.device))
    logits_NV.index_copy_(0, index, part)


def _force(mask_RW: torch.Tensor, forced: SequenceABC[tuple[int, int]]) -> None:
    """Rows ``r`` of ``(r, token)`` allow only ``token``, where their mask allows it (else
    the row stays: text inside a UTF-8 character, or a matcher that left its grammar)."""
    for r, t in forced:
        word, bit = divmod(t, 32)
        if (int(mask_RW[r, word]) >> bit) & 1:
            mask_RW[r].zero_()
            mask_RW[r, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32 bits


def _all_allowed(rows: int, vocab: int) -> torch.Tensor:
    """``[rows, W]`` int32 bitmask words, every bit set."""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


def _fill(executor: llg.LLExecutor, matchers: list, mask_RW: torch.Tensor, drafts=False) -> None:
    """Write each ``(matcher, row[, drafts])``'s masks into rows of ``mask_RW`` (llguidance,
    in parallel; the GIL is released). What ``llguidance.torch`` does, without importing it:
    that module imports ``torch._dynamo`` (~2 s at every engine start)."""
    ptr, row_bytes, rows = mask_RW.data_ptr(), mask_RW.shape[1] * 4, mask_RW.shape[0]
    if drafts:
        executor.unsafe_compute_mask_ptr_with_draft_token(matchers, ptr, row_bytes, rows)
    else:
        executor.unsafe_compute_mask_ptr(matchers, ptr, row_bytes, rows)
