"""Per-step attention metadata over the paged KV cache, built once per step by the model runner.

The KV cache of one layer is a tensor ``[num_slots, ...]`` with ``num_slots = num_blocks *
block_size``; token ``p`` of a sequence lives in slot ``block_table[p // bs] * bs + p % bs``.

Token layout of a step (T new tokens)::

    [ d0 d1 ... d{B_d-1} | p0 p0 p0 ... | p1 p1 ... ]
      one token per decode  one chunk per prefill sequence

Decodes read their whole context through ``decode_slots_BL`` (padded, masked); a prefill chunk
attends causally to its cached prefix plus itself through ``prefill_slots``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillChunk:
    token_start: int  # first row of this chunk in the step's token dimension
    num_tokens: int
    context_start: int  # tokens of this sequence already in the cache before the chunk
    slots_L: torch.Tensor | None  # flat slots of the whole context [context_start + num_tokens]


@dataclass(frozen=True)
class AttentionMetadata:
    num_decodes: int
    slot_mapping_T: torch.Tensor  # [T] where each new token's KV is written
    decode_slots_BL: torch.Tensor | None  # [num_decodes, L_max] context slots, 0 where padded
    decode_bias_B1L: torch.Tensor | None  # [num_decodes, 1, L_max] 0 for valid, -inf for padding
    prefills: tuple[PrefillChunk, ...]

    @staticmethod
    def build(
        starts: list[int],
        num_new: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences whose decodes (``num_new == 1``) come first."""
        num_decodes = 0
        while num_decodes < len(num_new) and num_new[num_decodes] == 1:
            num_decodes += 1

        def slots_of(table: list[int], start: int, stop: int) -> torch.Tensor:
            pos = torch.arange(start, stop)
            blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
            return blocks * block_size + pos % block_size

        slot_parts = [slots_of(t, s, s + n) for t, s, n in zip(block_tables, starts, num_new)]
        slot_mapping_T = torch.cat(slot_parts) if slot_parts else torch.empty(0, dtype=torch.long)
        decode_slots = decode_bias = None
        if num_decodes:
            lens = torch.tensor([s + 1 for s in starts[:num_decodes]])
            L = int(lens.max())
            n_blocks = (L + block_size - 1) // block_size
            table_BN = torch.zeros(num_decodes, n_blocks, dtype=torch.long)
            for b in range(num_decodes):
                t = block_tables[b][:n_blocks]
                table_BN[b, : len(t)] = torch.tensor(t, dtype=torch.long)
            pos_L = torch.arange(L)
            decode_slots = table_BN[:, pos_L // block_size] * block_size + pos_L % block_size
            valid_BL = pos_L[None, :] < lens[:, None]
            decode_slots = decode_slots.masked_fill(~valid_BL, 0)
            decode_bias = torch.zeros(num_decodes, 1, L).masked_fill_(
                ~valid_BL[:, None, :], float("-inf")
            )
        to = torch.device(device)
        prefills = []
        token_start = num_decodes
        for i in range(num_decodes, len(num_new)):
            s, n = starts[i], num_new[i]
            # a chunk that starts the sequence attends only to itself: no cache read needed
            ctx = slots_of(block_tables[i], 0, s + n).to(to) if s > 0 else None
            prefills.append(PrefillChunk(token_start, n, s, ctx))
            token_start += n
        return AttentionMetadata(
            num_decodes=num_decodes,
            slot_mapping_T=slot_mapping_T.to(to),
            decode_slots_BL=None if decode_slots is None else decode_slots.to(to),
            decode_bias_B1L=None if decode_bias is None else decode_bias.to(to),
            prefills=tuple(prefills),
        )


def causal_bias(
    num_q: int, context_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """[num_q, context_len] additive mask for queries at positions ``context_len - num_q ..``."""
    if num_q == 1:
        return None
    offset = context_len - num_q
    q_pos = torch.arange(num_q, device=device)[:, None] + offset
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = torch.zeros(num_q, context_len, dtype=dtype, device=device)
    return mask.masked_fill_(k_pos > q_pos, float("-inf"))
