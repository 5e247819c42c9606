"""Turns a scheduled :class:`Batch` into tensors, runs the model and samples.

For each scheduled sequence the runner returns a :class:`SeqStepOutput`: the sampled token
(only when the chunk reaches the sequence's last known token) and, for sequences that asked
for prompt logprobs, the entries for the prompt positions this chunk covered.

Under a parallel layout all ranks of a DP replica run the same batch. A pipeline stage takes
its input hidden states from the previous stage and sends its output to the next; the last
stage's TP rank 0 (the replica leader) samples and broadcasts the results to the replica, so
every rank's scheduler moves in step. A replica with nothing to run still runs an empty batch
when its MoE layers exchange tokens with other replicas (``run_empty``).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist

from moeserve.core import Batch, PositionLogprobs
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.objects import broadcast_json
from moeserve.engine import codec
from moeserve.engine.codec import SeqStepOutput
from moeserve.grammar.bank import GrammarBank, PendingMask
from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.layers.sampler import Sampler, compute_prompt_logprobs
from moeserve.models.base import MoECausalLM
from moeserve.spec.batch import attention_rows
from moeserve.spec.mtp import MTPProposer, MTPRows
from moeserve.spec.verify import Verified, verify


class ModelRunner:
    # structured output's matchers (the engine's, set on the replica leader that samples)
    grammars: GrammarBank | None = None

    def __init__(
        self,
        model: MoECausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device | str = "cpu",
        groups: ParallelGroups | None = None,
        num_spec_tokens: int = 0,
        proposer: MTPProposer | None = None,
    ) -> None:
        """With ``num_spec_tokens > 0`` every step verifies the batch's drafts and, where
        ``proposer`` is given (the replica leader), drafts the next ones (:meth:`_run_spec`)."""
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.groups = groups or ParallelGroups.single()
        self.sampler = Sampler()
        self.num_spec_tokens = num_spec_tokens
        self.proposer = proposer
        # the draft distribution of each random sequence's pending drafts (leader only)
        self._draft_probs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        model.bind_kv_caches(kv_caches)

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        starts, nums, tables = [], [], []
        for s in batch.seqs:
            ids.extend(s.seq.token_ids_slice(s.start, s.end))
            positions.extend(range(s.start, s.end))
            rows = attention_rows(s.start, s.num_new_tokens, s.seq.block_table, s.as_decode_rows)
            starts += rows[0]
            nums += rows[1]
            tables += rows[2]
        meta = AttentionMetadata.build(
            starts, nums, tables, self.block_size, self.device, num_decodes=batch.num_decodes
        )
        to = dict(dtype=torch.long, device=self.device)
        return torch.tensor(ids, **to), torch.tensor(positions, **to), meta

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[SeqStepOutput]:
        g = self.groups
        outputs: list[SeqStepOutput] = []
        sends = []
        if self.num_spec_tokens:
            outputs = self._run_spec(batch)
            return self._share(outputs)
        for mb in split_micro_batches(batch, g.dims.pp):
            input_ids_T, positions_T, meta = self.prepare(mb)
            masks = self._start_masks(mb)  # structured output: computed during the forward
            h_TD, send = self._forward_stage(input_ids_T, positions_T, meta)
            sends += send
            if g.is_last_stage and mb.seqs:
                outputs += self._sample(mb, h_TD, masks)
        for work in sends:
            work.wait()
        return self._share(outputs)

    def _share(self, outputs: list[SeqStepOutput]) -> list[SeqStepOutput]:
        """The replica leader's outputs, on every rank of the replica."""
        g = self.groups
        if g.replica.size > 1:
            lead = g.is_replica_leader
            sent = [codec.step_output_to_json(o) for o in outputs] if lead else None
            received = broadcast_json(sent, g.replica, g.replica_leader_index)
            if not lead:
                outputs = [codec.step_output_from_json(o) for o in received]
        return outputs

    @torch.inference_mode()
    def run_empty(self) -> None:
        """Forwards over no tokens, as many as a real step takes: they join the step's
        collectives and compute nothing."""
        meta = AttentionMetadata.build([], [], [], self.block_size, self.device)
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        for _ in range(self.groups.dims.pp):
            self._forward_stage(empty, empty, meta)

    def _forward_stage(
        self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, list]:
        """This stage's part of the forward. The input hidden states come from the previous
        stage; the output goes to the next one asynchronously (returned: the send to wait
        for), so this stage moves on to its next micro-batch while the next stage computes.
        Every stage of a replica runs the same micro-batches, so T agrees."""
        g, T = self.groups, input_ids_T.shape[0]
        h_in = None
        if not g.is_first_stage:
            h_in = torch.empty(
                T, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device
            )
            if T:
                dist.recv(h_in, src=g.pp.ranks[g.pp.rank - 1])
        h_TD = self.model(input_ids_T, positions_T, meta, h_in)
        sends = []
        if not g.is_last_stage and T:
            sends.append(dist.isend(h_TD.contiguous(), dst=g.pp.ranks[g.pp.rank + 1]))
        return h_TD, sends

    def _start_masks(self, batch: Batch) -> PendingMask | None:
        """The grammar masks of the rows this rank samples (structured output), started on
        the bank's worker thread; None without constrained rows or off the replica leader
        (whose samples are the ones kept)."""
        if self.grammars is None or not self.groups.is_replica_leader:  # leader: last stage
            return None
        seqs = [s.seq for s in batch.seqs if s.sample]
        return self.grammars.start(seqs, self.model.config.vocab_size)

    def _sample(
        self, batch: Batch, h_TD: torch.Tensor, masks: PendingMask | None = None
    ) -> list[SeqStepOutput]:
        outputs = self._prompt_logprobs(batch, h_TD)

        # the last row of each chunk that reaches its sequence's end samples the next token
        rows, seqs, idx = [], [], []
        row = 0
        for i, s in enumerate(batch.seqs):
            row += s.num_new_tokens
            if s.sample:
                rows.append(row - 1)
                seqs.append(s.seq)
                idx.append(i)
        if rows:
            # every row samples (decodes only): the rows as they are, not an indexed copy
            logits = self.model.compute_logits(h_TD if len(rows) == len(h_TD) else h_TD[rows])
            if masks is not None:  # structured output: each constrained row to its grammar
                masks.apply(logits)
            result = self.sampler(logits, seqs)
            for k, i in enumerate(idx):
                outputs[i] = dataclasses.replace(
                    outputs[i], token_id=result.token_ids[k], logprobs=result.logprobs[k]
                )
        return outputs

    def _run_spec(self, batch: Batch) -> list[SeqStepOutput]:
        """One step with speculative decoding (one pipeline stage):

        1. the target runs every entry's tokens plus its drafts (a decode with ``n`` drafts is
           an ``n + 1``-token chunk over its cached context);
        2. entries that sample verify their drafts (``spec/verify.py``) and emit
           ``accepted + 1`` tokens;
        3. the MTP layer covers the positions each entry keeps and drafts up to ``k`` tokens
           for the next step (``spec/mtp.py``), on the replica leader.
        Rejected positions need no undo: the scheduler keeps ``num_computed_tokens`` at the
        accepted length and later steps overwrite those slots.
        """
        entries = batch.seqs
        drafts = getattr(batch, "drafts", None) or tuple(() for _ in entries)
        h_TD, first_row = self._spec_forward(batch, drafts)
        if not entries or not self.groups.is_last_stage:
            return []
        outputs = self._spec_prompt_logprobs(batch, h_TD, first_row)
        emitted = self._spec_verify(batch, drafts, h_TD, first_row)
        new_drafts = self._spec_propose(batch, h_TD, first_row, emitted)
        return self._spec_outputs(batch, outputs, emitted, new_drafts)

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _spec_forward(
        self, batch: Batch, drafts: tuple[tuple[int, ...], ...]
    ) -> tuple[torch.Tensor, list[int]]:
        """The target's forward over every entry's tokens followed by its drafts; returns the
        hidden states and each entry's first row in them. Decodes and verifications come
        first, as one decode row per token (the paged decode path, spec/batch.py:
        attention_rows), then prefill chunks."""
        entries = batch.seqs
        as_dec = [bool(drafts[i]) or e.is_decode for i, e in enumerate(entries)]
        order = sorted(range(len(entries)), key=lambda i: not as_dec[i])
        ids, positions, starts, nums, tables = [], [], [], [], []
        first_row = [0] * len(entries)
        decode_rows = 0
        for i in order:
            e = entries[i]
            first_row[i] = len(ids)
            n = e.num_new_tokens + len(drafts[i])
            ids += e.seq.token_ids_slice(e.start, e.end) + list(drafts[i])
            positions += range(e.start, e.start + n)
            rows = attention_rows(e.start, n, e.seq.block_table, as_dec[i])
            starts += rows[0]
            nums += rows[1]
            tables += rows[2]
            decode_rows += n if as_dec[i] else 0
        meta = AttentionMetadata.build(
            starts, nums, tables, self.block_size, self.device, num_decodes=decode_rows
        )
        h_TD, _ = self._forward_stage(self._long(ids), self._long(positions), meta)
        return h_TD, first_row

    def _spec_prompt_logprobs(
        self, batch: Batch, h_TD: torch.Tensor, first_row: list[int]
    ) -> list[SeqStepOutput]:
        """:meth:`_prompt_logprobs` over the entries' own rows (not their drafts'), in batch
        order."""
        entries = batch.seqs
        if not any(e.seq.wants_prompt_logprobs for e in entries):
            return [SeqStepOutput() for _ in entries]
        own = [
            r
            for i, e in enumerate(entries)
            for r in range(first_row[i], first_row[i] + e.num_new_tokens)
        ]
        return self._prompt_logprobs(batch, h_TD[self._long(own)])

    def _spec_verify(
        self,
        batch: Batch,
        drafts: tuple[tuple[int, ...], ...],
        h_TD: torch.Tensor,
        first_row: list[int],
    ) -> dict[int, Verified]:
        """What each sampling entry (by its index in the batch) emits: its drafts verified
        against the target's logits at its last token and after each draft. A random entry's
        drafts are verified only where their draft distribution is here (the leader)."""
        entries = batch.seqs
        sampling = [i for i, e in enumerate(entries) if e.sample]
        checked: dict[int, tuple[int, ...]] = {}  # the drafts each sampling entry verifies
        probs = []
        for i in sampling:
            seq, d = entries[i].seq, drafts[i]
            q = self._draft_probs.pop(seq, None)
            if d and not seq.params.greedy and (q is None or q.shape[0] != len(d)):
                d = ()  # no draft distribution here (not the leader): verify nothing
            checked[i] = d
            probs.append(q)
        rows = [
            r
            for i in sampling
            for r in range(
                first_row[i] + entries[i].num_new_tokens - 1,
                first_row[i] + entries[i].num_new_tokens + len(checked[i]),
            )
        ]
        verified = []
        if sampling:
            logits = self.model.compute_logits(h_TD[self._long(rows)])
            if self.grammars is not None and self.groups.is_replica_leader:  # drafts vs grammar
                self.grammars.mask_drafts(
                    logits, [entries[i].seq for i in sampling], [checked[i] for i in sampling]
                )
            verified = verify(
                logits, [entries[i].seq for i in sampling], [checked[i] for i in sampling], probs
            )
        return dict(zip(sampling, verified, strict=True))

    def _spec_propose(
        self,
        batch: Batch,
        h_TD: torch.Tensor,
        first_row: list[int],
        emitted: dict[int, Verified],
    ) -> list[tuple[list[int], list]]:
        """Per entry, the drafts for the next step and their distributions (none off the
        leader): the MTP layer over the positions each entry keeps."""
        entries = batch.seqs
        if self.proposer is None:
            return [([], []) for _ in entries]
        mtp_rows = []
        for i, e in enumerate(entries):
            v = emitted.get(i)
            if v is None:  # a chunk inside the prompt: its next tokens are known
                next_ids, history, k = e.seq.token_ids_slice(e.start + 1, e.end + 1), [], 0
            else:
                next_ids = e.seq.token_ids_slice(e.start + 1, e.end) + v.token_ids
                history, k = v.token_ids, self._num_drafts(e.seq, len(v.token_ids))
            mtp_rows.append(MTPRows(e.seq, first_row[i], e.start, next_ids, k, history))
        return self.proposer.propose(h_TD, mtp_rows)

    def _spec_outputs(
        self,
        batch: Batch,
        outputs: list[SeqStepOutput],
        emitted: dict[int, Verified],
        new_drafts: list[tuple[list[int], list]],
    ) -> list[SeqStepOutput]:
        """The step's outputs: the emitted tokens and the new drafts of each sampling entry
        (a random entry's draft distribution is kept for the next step's verification)."""
        entries = batch.seqs
        for i, v in emitted.items():
            d, q = new_drafts[i]
            if d and not entries[i].seq.params.greedy:
                self._draft_probs[entries[i].seq] = torch.stack(q)
            outputs[i] = dataclasses.replace(
                outputs[i],
                token_id=v.token_ids[0],
                logprobs=v.logprobs[0],
                more_token_ids=tuple(v.token_ids[1:]),
                more_logprobs=tuple(v.logprobs[1:]),
                draft_token_ids=tuple(d),
            )
        return outputs

    def _num_drafts(self, seq, num_emitted: int) -> int:
        """Drafts worth proposing after ``num_emitted`` new tokens: at most k, and fewer than
        the tokens max_tokens and max_model_len still allow (the last one is never a draft)."""
        left = seq.max_model_len - (seq.num_tokens + num_emitted)
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - (len(seq.output_token_ids) + num_emitted))
        return max(0, min(self.num_spec_tokens, left - 1))

    def _prompt_logprobs(self, batch: Batch, h_TD: torch.Tensor) -> list[SeqStepOutput]:
        """Entries for the prompt positions each chunk covers, for sequences that asked.

        The row at position p predicts prompt token p + 1; positions already recorded (a
        chunk recomputed after preemption) are skipped, and the first prompt token gets None.
        """
        outputs = [SeqStepOutput() for _ in batch.seqs]
        row = 0
        for i, s in enumerate(batch.seqs):
            seq, chunk_row = s.seq, row
            row += s.num_new_tokens
            if not seq.wants_prompt_logprobs:
                continue
            first = max(s.start, len(seq.prompt_logprobs) - 1)
            last = min(s.end, seq.num_prompt_tokens - 1)
            entries: list[PositionLogprobs | None] = []
            if last > first:
                rows = list(range(chunk_row + first - s.start, chunk_row + last - s.start))
                targets = torch.tensor(
                    seq.prompt_token_ids[first + 1 : last + 1], device=h_TD.device
                )
                logits = self.model.compute_logits(h_TD[rows])
                entries = list(compute_prompt_logprobs(logits, targets, seq.params.prompt_logprobs))
            position = first + 1
            if not seq.prompt_logprobs and s.start == 0:
                entries.insert(0, None)  # the first prompt token has no distribution
                position = 0
            if entries:
                outputs[i] = SeqStepOutput(prompt_logprobs=entries, first_position=position)
        return outputs


def split_micro_batches(batch: Batch, n: int) -> list[Batch]:
    """``n`` consecutive slices of the batch's sequences with about equal token counts (some
    may be empty); decodes stay before prefills inside each. Pipeline stages work on one
    micro-batch while the next stage works on the previous one."""
    if n == 1:
        return [batch]
    total = sum(s.num_new_tokens for s in batch.seqs)
    parts: list[list] = [[] for _ in range(n)]
    done = 0
    for s in batch.seqs:
        # the part whose share of the tokens this sequence's midpoint falls in
        k = min(n - 1, (2 * done + s.num_new_tokens) * n // (2 * max(total, 1)))
        parts[k].append(s)
        done += s.num_new_tokens
    return [Batch(tuple(p)) for p in parts]
