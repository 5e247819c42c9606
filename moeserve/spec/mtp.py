"""The MTP draft proposer: DeepSeek's next-token-prediction layer run after each target step.

Alignment (one sequence; ``h_i`` is the target's final hidden state at position ``i``)::

    position            i          the MTP row for position i reads h_i and token t_{i+1},
    MTP input           h_i, t_{i+1}   writes its latent KV into the MTP cache slot of
    MTP output          predicts t_{i+2}   position i (same block table as the target)

So the MTP pass of a step covers exactly the positions the target computed and kept: the
chunk's rows, or after a verification the last known token plus the accepted drafts. Its last
row predicts the token after the one just emitted: draft ``d_1``. For ``k > 1`` the layer is
applied again on its own output (SGLang's and Chitu's recursion): row ``(h'_{p}, d_{j-1})`` at
position ``p + 1`` gives ``d_j``. Those speculative rows write MTP-cache slots past the kept
positions; the next step's MTP pass rewrites them before anything reads them, so rolling back
is only a matter of ``num_computed_tokens``. RoPE is relative, so using position ``i`` for the
row (transformers uses ``i + 1``) changes no score.

With a hot vocabulary (``spec/hot_vocab.py``) the drafts' logits cover the hot ids only.

Shape suffixes: T rows, D model dim, B sequences, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from moeserve.core import Sequence
from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.spec.batch import attention_rows, runs_as_decodes
from moeserve.spec.hot_vocab import HotVocab
from moeserve.spec.verify import SeqView, sample_drafts


@dataclass(frozen=True)
class MTPRows:
    """One sequence's share of the MTP pass: target rows ``[start, start + len(next_ids))``
    of the step's hidden states, at positions ``position ..``; ``next_ids[i]`` is the token
    after position ``position + i``. ``num_drafts`` drafts are wanted from its last row (0:
    the pass only fills the MTP cache, e.g. a chunk inside the prompt)."""

    seq: Sequence
    row: int
    position: int
    next_ids: list[int]
    num_drafts: int
    history: list[int]  # tokens emitted this step, not yet in seq.output_token_ids


class MTPProposer:
    """Runs the MTP layer ``layer`` (an ``MTPLayer`` of ``models/deepseek_v3.py``) over its
    own KV cache, bound by the engine; drafts from ``hot`` ids only when given."""

    def __init__(
        self,
        layer: torch.nn.Module,
        block_size: int,
        device: torch.device,
        hot: HotVocab | None = None,
    ) -> None:
        self.layer = layer
        self.block_size = block_size
        self.device = device
        self.hot = hot

    def draft_logits(self, h_BD: torch.Tensor) -> torch.Tensor:
        """fp32 ``[B, V]``: the layer's head, or over the hot ids only (-inf elsewhere)."""
        if self.hot is not None:
            return self.hot.full_logits(h_BD)
        return self.layer.compute_logits(h_BD)

    def propose(
        self, h_TD: torch.Tensor, entries: SequenceABC[MTPRows]
    ) -> list[tuple[list[int], list[torch.Tensor | None]]]:
        """Fill the MTP cache for every entry's positions and draft ``num_drafts`` tokens from
        the last row of each; returns per entry (draft ids, their distributions)."""
        result: list[tuple[list[int], list[torch.Tensor | None]]] = [([], []) for _ in entries]
        live = [i for i, e in enumerate(entries) if e.next_ids]
        if not live:
            return result
        # short rows over a cached context as decode rows first, then prefill chunks
        as_dec = {i: runs_as_decodes(entries[i].position, len(entries[i].next_ids)) for i in live}
        order = sorted(live, key=lambda i: not as_dec[i])
        rows, ids, positions, starts, nums, tables = [], [], [], [], [], []
        for i in order:
            e = entries[i]
            n = len(e.next_ids)
            rows += range(e.row, e.row + n)
            ids += e.next_ids
            positions += range(e.position, e.position + n)
            r = attention_rows(e.position, n, e.seq.block_table, as_dec[i])
            starts += r[0]
            nums += r[1]
            tables += r[2]
        meta = AttentionMetadata.build(starts, nums, tables, self.block_size, self.device)
        to = dict(dtype=torch.long, device=self.device)
        out_TD = self.layer(
            torch.tensor(ids, **to),
            torch.tensor(positions, **to),
            h_TD[torch.tensor(rows, **to)],
            meta,
        )
        # the last row of each entry that wants drafts, in ``order``
        want, last_rows, ends = [], [], 0
        for i in order:
            ends += len(entries[i].next_ids)
            if entries[i].num_drafts > 0:
                want.append(i)
                last_rows.append(ends - 1)
        if not want:
            return result
        h_BD = out_TD[torch.tensor(last_rows, **to)]
        pos = [entries[i].position + len(entries[i].next_ids) for i in want]
        drafts: dict[int, list[int]] = {i: [] for i in want}
        probs: dict[int, list[torch.Tensor | None]] = {i: [] for i in want}
        step = 0
        while want:
            views = [SeqView.of(entries[i].seq, entries[i].history + drafts[i]) for i in want]
            toks, ps = sample_drafts(self.draft_logits(h_BD), views)
            for i, t, p in zip(want, toks, ps, strict=True):
                drafts[i].append(t)
                probs[i].append(p)
            step += 1
            keep = [b for b, i in enumerate(want) if entries[i].num_drafts > step]
            if not keep:
                break
            want = [want[b] for b in keep]
            # the layer again on its own output: (h'_p, d_step) at position p + 1
            idx = torch.tensor(keep, **to)
            meta = AttentionMetadata.build(
                [pos[b] - 1 + step for b in keep],
                [1] * len(keep),
                [entries[i].seq.block_table for i in want],
                self.block_size,
                self.device,
            )
            h_BD = self.layer(
                torch.tensor([drafts[i][-1] for i in want], **to),
                torch.tensor([pos[b] - 1 + step for b in keep], **to),
                h_BD[idx],
                meta,
            )
            pos = [pos[b] for b in keep]
        for i in drafts:
            result[i] = (drafts[i], probs[i])
        return result
