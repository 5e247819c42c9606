"""A scheduled step that carries draft tokens to verify."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.core import Batch


@dataclass(frozen=True)
class SpecBatch(Batch):
    """A :class:`Batch` whose entry ``i`` also verifies ``drafts[i]`` (empty for most entries:
    only a decode with drafts from the previous step has some). The target runs the entry's
    tokens followed by its drafts, so a decode with ``n`` drafts is an ``n + 1``-token chunk;
    the scheduler allocated slots for them and for the MTP recursion (``lookahead_slots``)."""

    drafts: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.drafts) != len(self.seqs):
            raise ValueError(f"got {len(self.drafts)} draft lists for {len(self.seqs)} entries")

    @property
    def num_tokens(self) -> int:
        return super().num_tokens + sum(len(d) for d in self.drafts)


def lookahead_slots(num_drafts: int, num_spec_tokens: int) -> int:
    """KV slots past an entry's tokens that a step with speculation may write: its drafts
    (target and MTP caches), then ``k - 1`` recursive MTP rows after the last kept token."""
    return num_drafts + max(num_spec_tokens - 1, 0)


# a chunk of at most this many rows over a cached context runs as one decode row per token
MAX_DECODE_ROWS = 16


def attention_rows(
    start: int, num_rows: int, table: list[int], as_decodes: bool
) -> tuple[list[int], list[int], list[list[int]]]:
    """(starts, num_new, block tables) for ``AttentionMetadata.build`` of ``num_rows`` tokens
    at positions ``start ..``. As decode rows, token ``j`` is its own one-token entry over the
    context ``[0, start + j]``: every row's KV is written before attention runs, so this is
    causal attention over the chunk, through the paged decode path (absorbed MLA, the C
    kernel) instead of expanding the whole latent context as a prefill chunk does."""
    if as_decodes:
        return list(range(start, start + num_rows)), [1] * num_rows, [table] * num_rows
    return [start], [num_rows], [table]


def runs_as_decodes(start: int, num_rows: int) -> bool:
    """A short chunk over a cached context (a verification, or the MTP rows it keeps)."""
    return num_rows == 1 or (start > 0 and num_rows <= MAX_DECODE_ROWS)
