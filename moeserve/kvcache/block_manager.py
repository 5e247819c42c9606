"""Paged KV-cache bookkeeping: which blocks each sequence owns, and the prefix cache.

Pure Python, no tensors: a block id ``b`` indexes token slots ``[b * block_size, (b + 1) *
block_size)`` of the pool's tensors (:mod:`moeserve.kvcache.pool`); token ``p`` of a sequence
lives in block ``seq.block_table[p // block_size]``.

Every block is in exactly one state::

    free       ref 0, no hash        in ``_free``          taken first by allocation, lowest
                                                           id first (a new sequence's blocks
                                                           then tend to follow each other:
                                                           fewer, longer KV-transfer writes)
    cached     ref 0, hash           in ``_evictable``     a prefix-cache entry nobody uses now;
                                                           evicted least recently freed first
    used       ref > 0               in some block tables  ref == number of tables holding it

Prefix caching: once all ``block_size`` tokens of a prompt block are computed, the block gets
the chained hash ``sha256(parent_hash + tokens)`` (``parent_hash`` is the previous block's hash,
empty for the first block), so a hash names the whole prefix up to the block's end, not only its
tokens. sha256 rather than Python's ``hash``: 256 bits make a collision (which would silently
reuse the wrong KV) negligible, and the value is the same in every process and host. A new
sequence reuses the longest chain of cached blocks that matches its tokens, but never all of
them: at least one token is left to compute, so the step has logits to sample from.

Only blocks of prompt tokens are cached: their KV was computed by the prefill path, as a cold
run of any prompt that starts with them computes it, so a hit gives the numbers a cold run
gives. A block holding generated tokens was computed by the decode path (MLA's absorbed
attention), which rounds differently (with bf16 weights, enough to change a later prompt's
greedy output); a next turn that repeats an answer recomputes it once, as part of its prompt,
and the turn after hits those blocks.
"""

from __future__ import annotations

import hashlib
import heapq
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence as SequenceABC

from moeserve.core import Sequence


def hash_block(parent: bytes, token_ids: SequenceABC[int]) -> bytes:
    """The chained hash of a full block: names the prefix ending with ``token_ids``."""
    tokens = array("q", token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()  # the same bytes on every host
    return hashlib.sha256(parent + tokens.tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks))  # a min-heap
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_to_block: dict[bytes, int] = {}
        # live sequences (those holding a block table) and the hash chain of their full blocks
        self._seqs: dict[int, Sequence] = {}
        self._seq_hashes: dict[int, list[bytes]] = {}
        self.prefix_cache_queries = 0  # tokens of admitted sequences that looked up the cache
        self.prefix_cache_hits = 0  # of those, tokens served from the cache

    # -- counters ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Evictable prefix-cache blocks (ref 0, hash kept)."""
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of the pool pinned by sequences (0.0 to 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # -- allocation ---------------------------------------------------------------------------

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of a new ``seq``'s tokens; changes nothing.

        At most ``(num_tokens - 1) // block_size`` blocks, so one token is always left to
        compute. Empty when caching is off or ``seq`` wants prompt logprobs (those need the
        logits of every prompt position).
        """
        if not self._uses_cache(seq):
            return []
        bs, parent, hits = self.block_size, b"", []
        for i in range((seq.num_tokens - 1) // bs):
            parent = hash_block(parent, seq.token_ids_slice(i * bs, (i + 1) * bs))
            block = self._hash_to_block.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_blocks: SequenceABC[int] = (),
        lookahead: int = 0,
    ) -> bool:
        """Whether :meth:`allocate` would succeed with the same arguments."""
        needed, existing = self._blocks_needed(seq, num_new_tokens, cached_blocks, lookahead)
        # cached hits nobody uses leave the evictable pool when this sequence takes them
        revived = sum(1 for b in cached_blocks if self._ref[b] == 0)
        return needed - existing <= self.num_free_blocks - revived

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_blocks: SequenceABC[int] = (),
        lookahead: int = 0,
    ) -> None:
        """Make ``seq.block_table`` cover ``seq.num_computed_tokens + num_new_tokens`` slots,
        plus ``lookahead`` slots past the known tokens (speculative decoding writes draft
        positions there; they hold no computed token, so a rejection frees nothing early and
        later steps overwrite them).

        For a sequence without blocks (new, or preempted), ``cached_blocks`` is what
        :meth:`lookup_prefix` returned: their refs are taken and ``seq.num_computed_tokens``
        starts after them (``num_new_tokens`` counts from there). Raises ValueError when the
        pool lacks the blocks; call :meth:`can_allocate` first.
        """
        if not self.can_allocate(seq, num_new_tokens, cached_blocks, lookahead):
            raise ValueError(
                f"cannot allocate {num_new_tokens} tokens for sequence {seq.seq_id}: "
                f"only {self.num_free_blocks} free blocks; check can_allocate() first"
            )
        if seq.seq_id not in self._seqs:
            self._admit(seq, cached_blocks)
        needed = -(-(seq.num_computed_tokens + num_new_tokens + lookahead) // self.block_size)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free_block())

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq``'s prompt that became full of computed tokens in the
        cache (blocks reaching into its output are never registered: module docstring).

        Call after ``seq.num_computed_tokens`` advanced. A hash that already names another
        block keeps that block; this one stays unregistered and is freed as a plain block.
        """
        hashes = self._seq_hashes[seq.seq_id]
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // bs
        for i in range(len(hashes), full):
            parent = hashes[-1] if hashes else b""
            h = hash_block(parent, seq.token_ids_slice(i * bs, (i + 1) * bs))
            hashes.append(h)
            block = seq.block_table[i]
            if h not in self._hash_to_block and self._hash[block] is None:
                self._hash_to_block[h] = block
                self._hash[block] = h

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s refs (tail first, so its tail is evicted first), empty its block table
        and reset ``num_computed_tokens`` to 0. A no-op for a sequence without blocks."""
        if self._seqs.pop(seq.seq_id, None) is not None:
            del self._seq_hashes[seq.seq_id]
            for block in reversed(seq.block_table):
                self._ref[block] -= 1
                if self._ref[block] == 0:
                    if self._hash[block] is not None:
                        self._evictable[block] = None  # most recently used end
                    else:
                        heapq.heappush(self._free, block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    # -- internals ------------------------------------------------------------------------------

    def _uses_cache(self, seq: Sequence) -> bool:
        return self.enable_prefix_caching and not seq.wants_prompt_logprobs

    def _blocks_needed(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_blocks: SequenceABC[int],
        lookahead: int = 0,
    ) -> tuple[int, int]:
        """(blocks the table must hold, blocks it will hold without allocating)."""
        if seq.seq_id in self._seqs:
            if cached_blocks:
                raise ValueError("cached_blocks apply only to a sequence without blocks")
            computed, existing = seq.num_computed_tokens, len(seq.block_table)
        else:
            if seq.block_table or seq.num_computed_tokens:
                raise ValueError(f"sequence {seq.seq_id} has KV state this manager does not own")
            computed, existing = len(cached_blocks) * self.block_size, len(cached_blocks)
        if num_new_tokens < 1 or computed + num_new_tokens > seq.num_tokens:
            raise ValueError(
                f"num_new_tokens={num_new_tokens} is out of range: {computed} of "
                f"{seq.num_tokens} tokens are computed"
            )
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        return -(-(computed + num_new_tokens + lookahead) // self.block_size), existing

    def _admit(self, seq: Sequence, cached_blocks: SequenceABC[int]) -> None:
        for block in cached_blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
        num_hit = len(cached_blocks) * self.block_size
        if self._uses_cache(seq):
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit
        if seq.num_preemptions == 0:  # report what the first admission got
            seq.num_cached_prompt_tokens = min(num_hit, seq.num_prompt_tokens)
        seq.block_table = list(cached_blocks)
        seq.num_computed_tokens = num_hit
        self._seqs[seq.seq_id] = seq
        self._seq_hashes[seq.seq_id] = [self._hash[b] for b in cached_blocks]  # type: ignore[misc]

    def _take_free_block(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:  # evict the least recently used cached block
            block, _ = self._evictable.popitem(last=False)
            del self._hash_to_block[self._hash[block]]  # type: ignore[index]
            self._hash[block] = None
        self._ref[block] = 1
        return block

    # -- self-check ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (used by tests and idle
        checks): every block in exactly one state, refs matching tables, hashes consistent."""

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise AssertionError(f"block manager: {message}")

        free, evictable = set(self._free), set(self._evictable)
        require(len(free) == len(self._free), "a block is on the free list twice")
        require(not free & evictable, f"blocks both free and cached: {sorted(free & evictable)}")
        held = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            table = seq.block_table
            require(len(set(table)) == len(table), f"sequence {seq_id} holds a block twice")
            require(
                seq.num_computed_tokens <= len(table) * self.block_size,
                f"sequence {seq_id}: {seq.num_computed_tokens} computed tokens but only "
                f"{len(table)} blocks",
            )
            require(
                len(self._seq_hashes[seq_id]) <= seq.num_computed_tokens // self.block_size,
                f"sequence {seq_id} hashed a block that is not fully computed",
            )
            for block in table:
                held[block] += 1
        used = 0
        for block, (ref, h) in enumerate(zip(self._ref, self._hash, strict=True)):
            require(ref == held[block], f"block {block} has ref {ref} but {held[block]} holders")
            if ref > 0:
                used += 1
                require(block not in free and block not in evictable, f"used block {block} free")
            elif h is None:
                require(block in free, f"block {block} (ref 0, no hash) is not on the free list")
            else:
                require(block in evictable, f"cached block {block} (ref 0) is not evictable")
            if h is not None:
                require(self._hash_to_block.get(h) == block, f"block {block}'s hash not mapped")
        require(
            used + len(free) + len(evictable) == self.num_blocks,
            f"used {used} + free {len(free)} + cached {len(evictable)} != {self.num_blocks}",
        )
        for h, block in self._hash_to_block.items():
            require(self._hash[block] == h, f"hash map names block {block} with another hash")
