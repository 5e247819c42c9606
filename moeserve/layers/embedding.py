"""Vocabulary-parallel token embedding and LM head.

Shape legend: T tokens, D model dim, V vocabulary, Vl rows per rank (``ceil(V / tp)``; the last
rank's tail past V is zero padding).

Rank r holds rows ``[r * Vl, (r + 1) * Vl)`` of the ``[V, D]`` table. The embedding looks up the
ids that fall in its rows, zeroes the others and sums over ``tp``; the head computes its ``Vl``
logits and gathers all of them over ``tp``.
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.distributed.groups import Axis
from moeserve.layers.linear import shard_spec
from moeserve.models.weights import WeightSpec
from moeserve.ops.linear import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, tp: Axis, dtype=torch.float32) -> None:
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.rows = -(-vocab // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden, dtype=dtype), requires_grad=False)

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.weight[ids_T]
        local_T = ids_T - self.start
        outside_T = (local_T < 0) | (local_T >= self.rows)
        x_TD = self.weight[local_T.masked_fill(outside_T, 0)]
        x_TD.masked_fill_(outside_T.unsqueeze(-1), 0)
        return self.tp.all_reduce(x_TD)

    def weight_specs(self, name: str) -> dict[str, WeightSpec]:
        full = (self.vocab, self.weight.shape[1])
        return {name: shard_spec(full, self.weight, 0, self.tp.rank, self.rows)}


class ParallelLMHead(nn.Module):
    """``logits = h @ W.T`` with W vocab-parallel; ``weight`` may be the embedding's (tied)."""

    def __init__(self, vocab: int, hidden: int, tp: Axis, dtype=torch.float32, weight=None) -> None:
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.rows = -(-vocab // tp.size)
        self.tied = weight is not None
        self.weight = (
            weight
            if weight is not None
            else nn.Parameter(torch.empty(self.rows, hidden, dtype=dtype), requires_grad=False)
        )

    def forward(self, h_ND: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, V]``."""
        logits = linear(h_ND, self.weight).float()
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.vocab]

    def weight_specs(self, name: str) -> dict[str, WeightSpec]:
        if self.tied:
            return {}
        full = (self.vocab, self.weight.shape[1])
        return {name: shard_spec(full, self.weight, 0, self.tp.rank, self.rows)}
