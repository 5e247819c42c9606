"""Per-step attention metadata over the paged KV cache, built once per step by the model runner.

The KV cache of one layer is a tensor ``[num_slots, ...]`` with ``num_slots = num_blocks *
block_size``; token ``p`` of a sequence lives in slot ``block_table[p // bs] * bs + p % bs``.

Token layout of a step (T new tokens)::

    [ d0 d1 ... d{B_d-1} | p0 p0 p0 ... | p1 p1 ... ]
      one token per decode  one chunk per prefill sequence

Decodes read their context straight from the paged cache through ``decode_block_table_BN`` and
``decode_context_lens_B`` (the decode kernels of ``ops/cpu/attention.py``); the gather
references read it through ``decode_slots_BL`` and ``decode_bias_B1L``, built from those on
first use. A prefill chunk attends causally to its cached prefix plus itself through
``slots_L``; it may be a single token (the last prompt token after a prefix-cache hit), which
still takes the prefill path, as it does in a cold run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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
    # [num_decodes, blocks of the longest context] int32 block ids, rows padded with 0
    decode_block_table_BN: torch.Tensor | None
    decode_context_lens_B: torch.Tensor | None  # [num_decodes] int32, the new token included
    block_size: int
    prefills: tuple[PrefillChunk, ...]

    @cached_property
    def decode_kernel_args(self) -> tuple[int, int, int, int] | None:
        """``(block table pointer, its row stride, context lengths pointer, block size)`` for
        the paged decode kernel (``ops/cpu/attention.c``), int32 and contiguous; None without
        decodes or off the CPU. Derived once per step for every layer."""
        table, lens = self.decode_block_table_BN, self.decode_context_lens_B
        if not self.num_decodes or table.device.type != "cpu":
            return None
        table = table.to(torch.int32).contiguous()
        lens = lens.to(torch.int32).contiguous()
        self.__dict__["_decode_int32"] = (table, lens)  # keeps the pointers valid
        return table.data_ptr(), table.stride(0), lens.data_ptr(), self.block_size

    @cached_property
    def decode_slots_BL(self) -> torch.Tensor | None:
        """[num_decodes, L_max] context slots, 0 where padded (built on first use)."""
        if not self.num_decodes:
            return None
        lens_B, bs = self.decode_context_lens_B, self.block_size
        pos_L = torch.arange(int(lens_B.max()), device=lens_B.device)
        slots_BL = self.decode_block_table_BN[:, pos_L // bs].long() * bs + pos_L % bs
        return slots_BL.masked_fill_(pos_L[None, :] >= lens_B[:, None], 0)

    @cached_property
    def decode_bias_B1L(self) -> torch.Tensor | None:
        """[num_decodes, 1, L_max] 0 for context, -inf for padding (built on first use)."""
        if not self.num_decodes:
            return None
        lens_B = self.decode_context_lens_B
        pos_L = torch.arange(int(lens_B.max()), device=lens_B.device)
        pad_BL = pos_L[None, :] >= lens_B[:, None]
        bias_BL = torch.zeros(pad_BL.shape, device=lens_B.device)
        return bias_BL.masked_fill_(pad_BL, float("-inf"))[:, None, :]

    @staticmethod
    def build(
        starts: list[int],
        num_new: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        num_decodes: int | None = None,
    ) -> AttentionMetadata:
        """Metadata for sequences whose ``num_decodes`` decodes (one new token each, run
        through the decode path) come first; the entries after them are prefill chunks, of
        one token too. ``num_decodes=None``: every leading one-token entry is a decode. Plain
        Python lists, then one tensor each: a few tensor ops per step, not per sequence.
        Raises ValueError when one of the first ``num_decodes`` entries has more tokens."""
        bs = block_size
        if num_decodes is None:
            num_decodes = 0
            while num_decodes < len(num_new) and num_new[num_decodes] == 1:
                num_decodes += 1
        elif any(n != 1 for n in num_new[:num_decodes]):
            raise ValueError(f"the first {num_decodes} entries must be decodes, got {num_new}")

        def slots_of(table: list[int], start: int, stop: int) -> list[int]:
            return [table[p // bs] * bs + p % bs for p in range(start, stop)]

        slots: list[int] = []
        for table, s, n in zip(block_tables, starts, num_new):
            slots += slots_of(table, s, s + n)
        to = torch.device(device)
        table_BN = lens_B = None
        if num_decodes:
            lens = [s + 1 for s in starts[:num_decodes]]
            n_blocks = (max(lens) + bs - 1) // bs
            rows = [t[:n_blocks] for t in block_tables[:num_decodes]]
            rows = [r + [0] * (n_blocks - len(r)) for r in rows]
            table_BN = torch.tensor(rows, dtype=torch.int32, device=to)
            lens_B = torch.tensor(lens, dtype=torch.int32, device=to)
        prefills = []
        token_start = num_decodes
        for i in range(num_decodes, len(num_new)):
            s, n = starts[i], num_new[i]
            # a chunk that starts the sequence attends only to itself: no cache read needed
            ctx = None
            if s > 0:
                ctx = torch.tensor(slots_of(block_tables[i], 0, s + n), device=to)
            prefills.append(PrefillChunk(token_start, n, s, ctx))
            token_start += n
        return AttentionMetadata(
            num_decodes=num_decodes,
            slot_mapping_T=torch.tensor(slots, dtype=torch.long, device=to),
            decode_block_table_BN=table_BN,
            decode_context_lens_B=lens_B,
            block_size=bs,
            prefills=tuple(prefills),
        )
