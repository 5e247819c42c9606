"""Turns a scheduled :class:`Batch` into tensors, runs the model and samples.

For each scheduled sequence the runner returns a :class:`SeqStepOutput`: the sampled token
(only when the chunk reaches the sequence's last known token) and, for sequences that asked
for prompt logprobs, the entries for the prompt positions this chunk covered.
"""

from __future__ import annotations

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

        # rows whose logits we need: the last row of sampling chunks, and the prompt rows of
        # sequences that asked for prompt logprobs (row at position p predicts prompt token p+1)
        sample_rows, sample_seqs = [], []
        plp_rows: list[int] = []
        plp_targets: list[int] = []
        plp_spans: dict[int, tuple[int, int, int]] = {}  # batch idx -> (first row in plp, n, pos)
        row = 0
        for i, s in enumerate(batch.seqs):
            seq = s.seq
            if s.sample:
                sample_rows.append(row + s.num_new_tokens - 1)
                sample_seqs.append(seq)
            if seq.wants_prompt_logprobs:
                first = max(s.start, len(seq.prompt_logprobs) - 1)  # skip already recorded
                last = min(s.end, seq.num_prompt_tokens - 1)  # positions predicting the prompt
                if last > first:
                    plp_spans[i] = (len(plp_rows), last - first, first)
                    plp_rows.extend(range(row + first - s.start, row + last - s.start))
                    plp_targets.extend(seq.prompt_token_ids[first + 1 : last + 1])
                elif s.start == 0 and not seq.prompt_logprobs:
                    plp_spans[i] = (len(plp_rows), 0, 0)
            row += s.num_new_tokens

        outputs = [SeqStepOutput() for _ in batch.seqs]
        if plp_spans:
            plp_entries: list[PositionLogprobs] = []
            if plp_rows:
                logits = self.model.compute_logits(h_TD[plp_rows])
                # every seq with prompt logprobs asks the same N per seq; group by N
                nums = {}
                for i, (off, n, _) in plp_spans.items():
                    nums.setdefault(batch.seqs[i].seq.params.prompt_logprobs, []).append((off, n))
                plp_entries = [None] * len(plp_rows)  # type: ignore[list-item]
                targets = torch.tensor(plp_targets, dtype=torch.long, device=self.device)
                for num_top, spans in nums.items():
                    idx = [r for off, n in spans for r in range(off, off + n)]
                    got = compute_prompt_logprobs(logits[idx], targets[idx], num_top)
                    for r, entry in zip(idx, got):
                        plp_entries[r] = entry
            for i, (off, n, pos) in plp_spans.items():
                seq = batch.seqs[i].seq
                entries: list[PositionLogprobs | None] = list(plp_entries[off : off + n])
                first_position = pos + 1
                if not seq.prompt_logprobs and batch.seqs[i].start == 0:
                    entries = [None, *entries]  # the first prompt token has no distribution
                    first_position = 0
                outputs[i] = SeqStepOutput(prompt_logprobs=entries, first_position=first_position)

        if sample_rows:
            logits = self.model.compute_logits(h_TD[sample_rows])
            result = self.sampler(logits, sample_seqs)
            k = 0
            for i, s in enumerate(batch.seqs):
                if s.sample:
                    prev = outputs[i]
                    outputs[i] = SeqStepOutput(
                        token_id=result.token_ids[k],
                        logprobs=result.logprobs[k],
                        prompt_logprobs=prev.prompt_logprobs,
                        first_position=prev.first_position,
                    )
                    k += 1
        return outputs
