"""Continuous batching with a per-step token budget (vLLM V1 style).

Each :meth:`Scheduler.schedule` call builds one step:

1. RUNNING sequences, in order, each get ``num_tokens - num_computed_tokens`` tokens (1 for a
   decode; the rest of a partly computed prompt, cut to the budget left). When the blocks run
   out, the most recently arrived running sequence is preempted by recompute (blocks freed,
   back to the FRONT of the waiting queue) and the allocation retried; a sequence may preempt
   itself, and then it waits.
2. If nothing was preempted, WAITING sequences are admitted first come, first served while the
   budget, ``max_num_seqs`` and the free blocks allow, each after a prefix-cache lookup. A
   prompt longer than the budget left is chunked (chunked prefill) or waits for a later step.
   Admission never preempts.

A preempted sequence recomputes prompt + outputs as its "prompt"; ``num_tokens -
num_computed_tokens`` covers that with no special case.

Prefill/decode disaggregation (``moeserve/disagg/``) parks sequences: they hold blocks outside
both queues while their KV moves between instances. On a prefill instance a
``KVRole.PREFILL`` sequence (its prompt is the request's prompt less the last token) runs its
chunks as any prompt does but never samples; once its prompt is computed it is parked until
its blocks have been written to the decode instance (:meth:`Scheduler.release`). On a decode
instance a ``KVRole.DECODE`` sequence is admitted FCFS like any other, but takes blocks for
all its prompt tokens but the last and no token budget, and is parked until they arrive
(:meth:`Scheduler.kv_arrived`: it then runs its last prompt token, the step that samples its
first output, as a cache hit would). A parked sequence that is aborted keeps its blocks in
quarantine until the transfer can no longer touch them (:meth:`Scheduler.free_quarantined`).
The connector takes what each step parked or aborted from ``newly_parked`` and
``newly_quarantined``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from moeserve.core import (
    Batch,
    FinishReason,
    KVRole,
    PositionLogprobs,
    ScheduledSeq,
    Sequence,
    SequenceStatus,
)
from moeserve.kvcache.block_manager import BlockManager
from moeserve.spec.batch import SpecBatch, lookahead_slots

# what the model runner sampled for one entry of a Batch: (token id, its logprobs), both None
# for an entry that does not sample (a chunk ending inside the prompt)
SampledToken = tuple[int | None, PositionLogprobs | None]
# with speculative decoding, per entry: the tokens accepted after the sampled one, their
# logprobs, and the drafts proposed for the next step
SpecTokens = tuple[tuple[int, ...], tuple[PositionLogprobs | None, ...], tuple[int, ...]]


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; the server answers 503."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    num_blocks: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting: int | None = None  # sequences; None: unbounded
    num_spec_tokens: int = 0  # draft tokens per decode (speculative decoding); 0: off

    def __post_init__(self) -> None:
        checks = [
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (
                self.num_spec_tokens >= 0,
                f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}",
            ),
            (
                self.max_num_batched_tokens >= 1,
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
            ),
            (self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}"),
            (self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}"),
            (self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}"),
            (
                self.max_waiting is None or self.max_waiting >= 1,
                f"max_waiting must be None or >= 1, got {self.max_waiting}",
            ),
            (
                self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len}): enable chunked prefill or "
                "raise the token budget",
            ),
            (
                self.num_blocks * self.block_size >= self.max_model_len,
                f"the KV cache holds {self.num_blocks * self.block_size} tokens, fewer than one "
                f"sequence of max_model_len={self.max_model_len}: raise the KV-cache memory or "
                "lower max_model_len",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class Scheduler:
    """Owns the waiting and running queues and the block manager; see the module docstring.

    Invariants (:meth:`check_integrity`): waiting sequences hold no blocks; running ones hold
    blocks covering their computed tokens; every unfinished sequence is in exactly one queue.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # speculative decoding: drafts waiting to be verified, by seq_id, and counters
        self.drafts: dict[int, tuple[int, ...]] = {}
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # of those, accepted
        self.num_verify_steps = 0  # sequence-steps that verified at least one draft
        # disaggregation: sequences holding blocks outside the queues (module docstring)
        self.parked: dict[int, Sequence] = {}
        self.quarantined: dict[int, Sequence] = {}  # aborted while parked, blocks still held
        self.newly_parked: list[Sequence] = []  # taken by the connector after each step
        self.newly_quarantined: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def add(self, seq: Sequence, resumed: bool = False) -> None:
        """Queue a new sequence. Raises ValueError when its prompt leaves no room for an output
        token within max_model_len, QueueFullError when the bounded queue is full. A
        ``resumed`` sequence (one that ran on a replica since lost, with its outputs so far)
        was admitted before: the queue's bound does not refuse it."""
        limit = self.config.max_model_len
        if seq.num_prompt_tokens > limit - 1:
            raise ValueError(
                f"the prompt has {seq.num_prompt_tokens} tokens; max_model_len is {limit}, "
                "which must leave room for at least one output token"
            )
        if (
            not resumed
            and self.config.max_waiting is not None
            and len(self.waiting) >= self.config.max_waiting
        ):
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting} sequences); retry later"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> Batch | None:
        """Pick this step's sequences and allocate their slots; None when nothing can run."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        bm = self.block_manager
        preempted = False
        drafts: list[tuple[int, ...]] = []  # per scheduled entry, the drafts it verifies

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = _replay_chunk(
                seq, seq.num_computed_tokens, min(seq.num_tokens - seq.num_computed_tokens, budget)
            )
            d = self._drafts_for(seq, n, budget)
            ahead = self._lookahead(seq, n, len(d))
            while not bm.can_allocate(seq, n, lookahead=ahead):
                # the newest running sequence not yet scheduled this step (maybe seq itself)
                victim = max(self.running[i:], key=lambda s: (s.arrival_time, s.seq_id))
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                bm.allocate(seq, n, lookahead=ahead)
                scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
                drafts.append(d)
                budget -= n + len(d)
                i += 1

        receiving = self._num_receiving()  # parked for their KV: they count as running
        while (
            not preempted
            and self.waiting
            and len(self.running) + receiving < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if seq.kv_role is KVRole.DECODE:
                if not self._admit_receiving(seq):
                    break
                receiving += 1
                continue
            if budget <= 0:
                break
            cached = bm.lookup_prefix(seq)
            start = len(cached) * self.config.block_size
            n = _replay_chunk(seq, start, seq.num_tokens - start)
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            ahead = self._lookahead(seq, n, 0, len(cached) * self.config.block_size)
            if not bm.can_allocate(seq, n, cached, ahead):
                break
            self.waiting.popleft()
            bm.allocate(seq, n, cached, ahead)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            drafts.append(())
            budget -= n

        if not scheduled:
            return None
        # decode rows (a generated token, or a resumed sequence's earlier outputs) first, then
        # prefill chunks; stable within each group
        order = sorted(range(len(scheduled)), key=lambda j: not scheduled[j].as_decode_rows)
        entries = tuple(scheduled[j] for j in order)
        if not self.config.num_spec_tokens:
            return Batch(entries)
        for entry in entries:
            self.drafts.pop(entry.seq.seq_id, None)  # verified now, or dropped
        return SpecBatch(entries, tuple(drafts[j] for j in order))

    def _num_receiving(self) -> int:
        return sum(1 for s in self.parked.values() if s.kv_role is KVRole.DECODE)

    def _admit_receiving(self, seq: Sequence) -> bool:
        """Give a decode-role sequence blocks for every prompt token but the last and park
        it until they arrive; False when the blocks are not there."""
        n = seq.num_prompt_tokens - 1
        if not self.block_manager.can_allocate(seq, n):
            return False
        self.waiting.popleft()
        self.block_manager.allocate(seq, n)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        self._park(seq)
        return True

    def _park(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.PARKED
        self.parked[seq.seq_id] = seq
        self.newly_parked.append(seq)

    def kv_arrived(self, seq: Sequence) -> None:
        """The prompt KV of a parked decode-role sequence has been written into its blocks:
        it runs its last prompt token in the next step (a one-token prefill chunk)."""
        if seq.kv_role is not KVRole.DECODE or self.parked.pop(seq.seq_id, None) is None:
            raise ValueError(f"sequence {seq.seq_id} is not waiting for its KV")
        seq.num_computed_tokens = seq.num_prompt_tokens - 1
        seq.kv_role = KVRole.LOCAL  # from here on (a preemption too) it is a local sequence
        self.block_manager.commit_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def release(
        self,
        seq: Sequence,
        reason: FinishReason,
        error: str | None = None,
        keep_blocks: bool = False,
    ) -> Sequence:
        """Finish a parked sequence and free its blocks: a prefill-role sequence whose KV has
        been sent (``LENGTH``), or one whose transfer failed (``ABORT`` with ``error``).
        ``keep_blocks``: a write may still land in them; they stay in quarantine until
        :meth:`free_quarantined`."""
        if self.parked.pop(seq.seq_id, None) is None:
            raise ValueError(f"sequence {seq.seq_id} is not parked")
        if keep_blocks:
            self.quarantined[seq.seq_id] = seq
        else:
            self.block_manager.free(seq)
        seq.finish(reason)
        seq.error = error
        return seq

    def free_quarantined(self, seq: Sequence) -> None:
        """Free the blocks of a sequence aborted while parked, once no transfer touches them."""
        if self.quarantined.pop(seq.seq_id, None) is not None:
            self.block_manager.free(seq)

    def _drafts_for(self, seq: Sequence, n: int, budget: int) -> tuple[int, ...]:
        """The drafts a decode verifies this step: none for a chunk, or when the token budget
        has no room for them."""
        d = self.drafts.get(seq.seq_id, ())
        if n != seq.num_tokens - seq.num_computed_tokens or n != 1 or n + len(d) > budget:
            return ()
        return d

    def _lookahead(
        self, seq: Sequence, n: int, num_drafts: int, computed: int | None = None
    ) -> int:
        """Slots past the entry's tokens that speculation may write (``spec/batch.py``), only
        for an entry that samples, never past max_model_len."""
        k = self.config.num_spec_tokens
        computed = seq.num_computed_tokens if computed is None else computed
        if not k or computed + n != seq.num_tokens:
            return 0
        room = self.config.max_model_len - (computed + n)
        return max(0, min(lookahead_slots(num_drafts, k), room))

    def update(
        self,
        batch: Batch,
        sampled: list[SampledToken],
        spec: list[SpecTokens] | None = None,
    ) -> list[Sequence]:
        """Apply a step's results: ``sampled[i]`` is ``(token_id, logprobs)`` for
        ``batch.seqs[i]``, both None when that entry does not sample.

        Advances every entry's ``num_computed_tokens``, registers newly full blocks in the
        prefix cache, appends sampled tokens and applies token-level stops (EOS, stop ids,
        max_tokens, max_model_len); finished sequences leave the running queue and free their
        blocks. Returns the sequences that got a token, finished or not. Entries aborted since
        :meth:`schedule` are skipped.

        With speculative decoding, ``spec[i]`` carries the drafts entry ``i`` accepted after its
        sampled token and the drafts for its next step: the tokens are appended one by one
        (a stop among them ends the sequence there), ``num_computed_tokens`` advances over the
        sampled token and the accepted drafts, and the rejected positions are simply past it.
        """
        if len(sampled) != len(batch.seqs):
            raise ValueError(f"got {len(sampled)} results for a batch of {len(batch.seqs)}")
        updated: list[Sequence] = []
        if spec is None:
            spec = [((), (), ())] * len(batch.seqs)
        verified = getattr(batch, "drafts", None) or [()] * len(batch.seqs)
        for entry, (token_id, logprobs), (more, more_lp, new_drafts), checked in zip(
            batch.seqs, sampled, spec, verified, strict=True
        ):
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_computed_tokens != entry.start:
                raise AssertionError(f"sequence {seq.seq_id} moved since it was scheduled")
            samples = entry.sample  # read before the append changes num_tokens
            if samples != (token_id is not None):
                raise ValueError(
                    f"sequence {seq.seq_id}: sample={samples} but got token {token_id!r}"
                )
            if not samples:
                seq.num_computed_tokens = entry.end
                self.block_manager.commit_full_blocks(seq)
                if seq.kv_role is KVRole.PREFILL and entry.end == seq.num_tokens:
                    self._park(seq)  # its prompt's KV is complete: it waits to be sent
                continue
            if checked:
                self.num_verify_steps += 1
                self.num_draft_tokens += len(checked)
                self.num_accepted_tokens += len(more)
            # the sampled token and the accepted drafts (kept drafts precede the last token)
            seq.num_computed_tokens = entry.end + len(more)
            for tok, lp in zip((token_id, *more), (logprobs, *more_lp), strict=True):
                seq.append_token(tok, lp)
                if not seq.check_token_stop() and seq.num_tokens >= self.config.max_model_len:
                    seq.finish(FinishReason.LENGTH)
                if seq.is_finished:
                    break
            # a stop among the accepted tokens: what follows it was never emitted
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            self.block_manager.commit_full_blocks(seq)
            if seq.is_finished:
                self.block_manager.free(seq)
            elif new_drafts:
                self.drafts[seq.seq_id] = tuple(new_drafts)
            updated.append(seq)
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return updated

    # -- leaving early ----------------------------------------------------------------------

    def finish(
        self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """Finish ``seq`` now (a stop string, found by the detokenizer): frees its blocks."""
        if seq.is_finished:
            return
        self._remove(seq)
        seq.finish(reason, stop_reason)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of ``request_id`` with ABORT, freeing its blocks
        before returning (a parked one's go to quarantine); returns those sequences (empty
        for an unknown id)."""
        seqs = [
            s
            for s in (*self.running, *self.waiting, *self.parked.values())
            if s.request_id == request_id
        ]
        for seq in seqs:
            self.finish(seq, FinishReason.ABORT)
        return seqs

    def _remove(self, seq: Sequence) -> None:
        self.drafts.pop(seq.seq_id, None)
        if seq.status is SequenceStatus.PARKED:
            # a transfer may still read or write its blocks: the connector frees them
            del self.parked[seq.seq_id]
            self.quarantined[seq.seq_id] = seq
            self.newly_quarantined.append(seq)
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.drafts.pop(seq.seq_id, None)  # recomputed from scratch, drafted again
        self.running.remove(seq)
        self.block_manager.free(seq)  # also resets num_computed_tokens to 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- self-check ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError when queues and blocks disagree (tests and idle checks)."""
        self.block_manager.check_integrity()
        bs = self.config.block_size
        running_ids = {s.seq_id for s in self.running}
        if len(running_ids) != len(self.running) or len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"scheduler: bad running queue ({len(self.running)} entries)")
        for seq in self.running:
            if seq.status is not SequenceStatus.RUNNING:
                raise AssertionError(f"scheduler: running sequence {seq.seq_id} is {seq.status}")
            if len(seq.block_table) * bs < seq.num_computed_tokens:
                raise AssertionError(
                    f"scheduler: sequence {seq.seq_id} has {seq.num_computed_tokens} computed "
                    f"tokens but {len(seq.block_table)} blocks of {bs}"
                )
        for seq in self.parked.values():
            if seq.status is not SequenceStatus.PARKED or seq.seq_id in running_ids:
                raise AssertionError(f"scheduler: parked sequence {seq.seq_id} is {seq.status}")
            if seq.kv_role is KVRole.LOCAL or not seq.block_table:
                raise AssertionError(f"scheduler: parked sequence {seq.seq_id} holds no transfer")
        for seq in self.quarantined.values():
            if not seq.is_finished or seq.seq_id in self.parked or seq.seq_id in running_ids:
                raise AssertionError(f"scheduler: quarantined sequence {seq.seq_id} is misplaced")
        for seq in self.waiting:
            if seq.status is not SequenceStatus.WAITING or seq.seq_id in running_ids:
                raise AssertionError(f"scheduler: waiting sequence {seq.seq_id} is misplaced")
            if seq.block_table or seq.num_computed_tokens:
                raise AssertionError(f"scheduler: waiting sequence {seq.seq_id} holds KV state")


REPLAY_ROWS = 32  # a resumed sequence's earlier outputs recomputed per step, at most


def _replay_chunk(seq: Sequence, start: int, n: int) -> int:
    """How many of the ``n`` tokens from ``start`` a sequence computes this step: all of them,
    except for a resumed sequence (``Sequence.replay_outputs``): the rest of its prompt (in
    chunks, as any prompt), then its earlier outputs ``REPLAY_ROWS`` at a time as decode rows
    (``ScheduledSeq.as_decode_rows``). The prefill path would round their KV otherwise than
    the decodes that first computed it, and the tokens after them could differ."""
    if not seq.replay_outputs:
        return n
    if start < seq.num_prompt_tokens:
        return min(n, seq.num_prompt_tokens - start)
    return min(n, REPLAY_ROWS)
