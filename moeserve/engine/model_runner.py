"""Turns a scheduled :class:`Batch` into tensors, runs the model and samples.

For each scheduled sequence the runner returns a :class:`SeqStepOutput`: the sampled token
(only when the chunk reaches the sequence's last known token) and, for sequences that asked
for prompt logprobs, the entries for the prompt positions this chunk covered.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moeserve.core import Batch, PositionLogprobs
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
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
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
        input_ids_T, positions_T, meta = self.prepare(batch)
        h_TD = self.model(input_ids_T, positions_T, meta)
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
