"""A reduced draft vocabulary (SGLang's ``--speculative-token-map``; FR-Spec, EAGLE's hot-token
maps): the MTP layer's LM head computes logits over a set of hot token ids only, and drafts are
proposed from that set.

The draft's head is the largest read of a draft step (``V x D`` weights for one or a few
rows); over ``H`` hot ids it reads ``H / V`` of it. Exactness does not depend on the set: a
greedy target still emits its own argmax, and rejection sampling compares the target with the
distribution the draft was actually drawn from, ``q`` renormalized over the hot ids and zero
elsewhere (:meth:`HotVocab.full_logits` puts -inf outside the set before the sampler's
processing). Only the accept length depends on how much of the target's mass the set covers.

A map is a file of token ids: ``.pt`` (a 1-D tensor or a list, as SGLang's), ``.json`` (a
list) or text (ids separated by whitespace or commas); or the ``n`` most frequent ids of a
token stream (:func:`most_frequent_ids`).

Shape suffixes: N rows, D model dim, V vocabulary, H hot ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch

from moeserve.ops import formats
from moeserve.ops.linear import linear


def most_frequent_ids(token_ids: Iterable[int], n: int, vocab_size: int) -> list[int]:
    """The ``n`` most frequent ids of a token stream (ties: the smaller id first), sorted by
    id; fewer when the stream has fewer distinct ids in ``[0, vocab_size)``."""
    if n < 1:
        raise ValueError(f"a hot vocabulary needs n >= 1 ids, got {n}")
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    counts_V = torch.bincount(ids, minlength=vocab_size)
    # stable sort by count, descending: equal counts keep id order
    order_V = torch.sort(counts_V, descending=True, stable=True).indices
    top = order_V[: min(n, int((counts_V > 0).sum()))]
    return sorted(top.tolist())


def load_token_map(path: str | Path, vocab_size: int) -> list[int]:
    """The sorted, distinct ids of a token-map file. Raises ValueError for a missing or empty
    file, or ids outside ``[0, vocab_size)``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"speculative token map {p}: not found (a .pt, .json or text file of ids)")
    if p.suffix == ".pt":
        obj = torch.load(p, map_location="cpu", weights_only=True)
        ids = torch.as_tensor(obj).flatten().tolist()
    elif p.suffix == ".json":
        ids = list(json.loads(p.read_text()))
    else:
        ids = [int(t) for t in p.read_text().replace(",", " ").split()]
    ids = sorted({int(t) for t in ids})
    if not ids:
        raise ValueError(f"speculative token map {p} holds no token ids")
    if ids[0] < 0 or ids[-1] >= vocab_size:
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise ValueError(
            f"speculative token map {p}: token id {bad} is out of range for vocab size {vocab_size}"
        )
    return ids


def save_token_map(path: str | Path, ids: Iterable[int]) -> None:
    """Write ids as :func:`load_token_map` reads them (``.pt``: a long tensor; else JSON)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    ids = sorted({int(t) for t in ids})
    if p.suffix == ".pt":
        torch.save(torch.tensor(ids, dtype=torch.long), p)
    else:
        p.write_text(json.dumps(ids) + "\n")


class HotVocab:
    """The rows of an LM head weight ``[V, D]`` (dense, or int8 with per-row scales) for the
    hot ids, copied once (``H x D``, contiguous)."""

    def __init__(self, head_weight: torch.Tensor, ids: Iterable[int]) -> None:
        ids = sorted({int(t) for t in ids})
        V = head_weight.shape[0]
        if not ids or ids[0] < 0 or ids[-1] >= V:
            raise ValueError(f"hot ids must be a non-empty subset of [0, {V}), got {len(ids)} ids")
        self.vocab_size = V
        self.ids_H = torch.tensor(ids, dtype=torch.long, device=head_weight.device)
        self.weight_HD = formats.of(head_weight).take_rows(head_weight, self.ids_H)

    def __len__(self) -> int:
        return self.ids_H.numel()

    def full_logits(self, h_ND: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, V]``: the head's over the hot ids, -inf elsewhere."""
        sub_NH = linear(h_ND, self.weight_HD).float()
        out_NV = torch.full(
            (h_ND.shape[0], self.vocab_size), -math.inf, dtype=torch.float32, device=h_ND.device
        )
        out_NV[:, self.ids_H] = sub_NH
        return out_NV
