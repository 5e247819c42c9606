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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.core import Batch, PositionLogprobs
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.objects import broadcast_json
from moeserve.engine import codec
from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.layers.sampler import Sampler, compute_prompt_logprobs
from moeserve.models.base import MoECausalLM


@dataclass(frozen=True)
class SeqStepOutput:
    token_id: int | None = None
    logprobs: PositionLogprobs | None = None
    # prompt-logprob entries for prompt positions [first_position, first_position + len)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    first_position: int = 0


class ModelRunner:
    def __init__(
        self,
        model: MoECausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device | str = "cpu",
        groups: ParallelGroups | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.groups = groups or ParallelGroups.single()
        self.sampler = Sampler()
        model.bind_kv_caches(kv_caches)

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        for s in batch.seqs:
            ids.extend(s.seq.token_ids_slice(s.start, s.end))
            positions.extend(range(s.start, s.end))
        meta = AttentionMetadata.build(
            [s.start for s in batch.seqs],
            [s.num_new_tokens for s in batch.seqs],
            [s.seq.block_table for s in batch.seqs],
            self.block_size,
            self.device,
        )
        to = dict(dtype=torch.long, device=self.device)
        return torch.tensor(ids, **to), torch.tensor(positions, **to), meta

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[SeqStepOutput]:
        g = self.groups
        outputs: list[SeqStepOutput] = []
        sends = []
        for mb in split_micro_batches(batch, g.dims.pp):
            input_ids_T, positions_T, meta = self.prepare(mb)
            h_TD, send = self._forward_stage(input_ids_T, positions_T, meta)
            sends += send
            if g.is_last_stage and mb.seqs:
                outputs += self._sample(mb, h_TD)
        for work in sends:
            work.wait()
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

    def _sample(self, batch: Batch, h_TD: torch.Tensor) -> list[SeqStepOutput]:
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
            result = self.sampler(self.model.compute_logits(h_TD[rows]), seqs)
            for k, i in enumerate(idx):
                outputs[i] = dataclasses.replace(
                    outputs[i], token_id=result.token_ids[k], logprobs=result.logprobs[k]
                )
        return outputs

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
