"""Weights and KV cache in transparent huge pages (2 MB) on Linux CPUs.

Decode streams every weight it uses once per step, a few KB per row, across hundreds of MB.
With 4 KB pages that is a TLB miss and a page walk every 4 KB of the stream; in memory
advised for huge pages (``madvise(MADV_HUGEPAGE)``, which the kernel honours when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``) it is one per
2 MB. Measured here (``docs/benchmarks.md``): the one-call MoE kernel of the benchmark model
reads its experts 3-10% faster, the same interleaved in one process.

Torch's allocator cannot be asked for that advice, so :func:`move_to_huge_pages` moves a
loaded module's large tensors into one private anonymous mapping that is advised before it
is touched, and :func:`huge_page_zeros` gives the KV cache the same. Views that shared a
storage still share one afterwards. ``MOESERVE_HUGE_PAGES=0`` turns both off (plain torch
allocations); so does a kernel with huge pages ``never``.
"""

from __future__ import annotations

import logging
import mmap
import os
from functools import cache

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each storage starts on a page (keeps every dtype and SIMD load aligned)
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@cache
def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``), or
    ``unavailable`` where there is none to read (not Linux, no THP)."""
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unavailable"


def enabled() -> bool:
    """Whether huge-page placement applies in this process."""
    return (
        os.environ.get("MOESERVE_HUGE_PAGES", "1") != "0"
        and thp_mode() in ("always", "madvise")
        and hasattr(mmap, "MADV_HUGEPAGE")
    )


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory (uint8) starting on a 2 MB boundary, advised for huge pages
    before anything touches it. The tensor's storage keeps the mapping alive."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to `region`
    skip = -raw.data_ptr() % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, skip, size - skip)
    return raw[skip : skip + nbytes]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` on the CPU, in huge pages where :func:`enabled` and the
    tensor fills at least one (fresh anonymous memory is zero, so nothing is written until
    used)."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not enabled() or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    return huge_page_buffer(nbytes).view(dtype).view(shape)


def _tensor_slots(module: nn.Module):
    """Every ``(owner, name, tensor)`` of the module tree: parameters, buffers and plain
    tensor attributes (derived weights such as MLA's absorbed ones)."""
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                yield mod._parameters, name, p
        for name, b in mod._buffers.items():
            if b is not None:
                yield mod._buffers, name, b
        for name, v in vars(mod).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                yield mod, name, v


def move_to_huge_pages(module: nn.Module, min_bytes: int = 1 << 20) -> int:
    """Move every CPU storage of at least ``min_bytes`` that the module's tensors use into one
    huge-page mapping; returns the bytes moved (0 when not :func:`enabled`).

    Each storage is copied once and every tensor that viewed it is re-pointed at the copy with
    its offset, sizes and strides, so shared storage stays shared; parameters keep their
    identity (``p.data`` is replaced). Storages are moved one at a time and the old one is
    released as soon as nothing refers to it, so loading does not need twice the memory.
    """
    if not enabled():
        return 0
    by_storage: dict[int, list[tuple[object, str, torch.Tensor]]] = {}
    sizes: dict[int, int] = {}
    params: set[int] = set()  # a parameter reached through two owners is moved once
    for owner, name, t in _tensor_slots(module):
        if t.device.type != "cpu" or t.is_sparse or t.is_quantized:
            continue
        if isinstance(t, nn.Parameter):
            if id(t) in params:
                continue
            params.add(id(t))
        storage = t.untyped_storage()
        if storage.nbytes() < min_bytes:
            continue
        key = storage.data_ptr()
        by_storage.setdefault(key, []).append((owner, name, t))
        sizes[key] = storage.nbytes()
    if not by_storage:
        return 0
    offsets, total = {}, 0
    for key in sorted(sizes):
        offsets[key] = total
        total += -(-sizes[key] // _ALIGN) * _ALIGN
    arena = huge_page_buffer(total)
    new_storage = arena.untyped_storage()
    base = arena.data_ptr() - new_storage.data_ptr()  # the arena's offset in its storage
    moved = 0
    while by_storage:
        key, refs = by_storage.popitem()
        start = base + offsets[key]
        old = refs[0][2].untyped_storage()
        arena[offsets[key] : offsets[key] + sizes[key]].copy_(
            torch.empty(0, dtype=torch.uint8).set_(old, 0, (sizes[key],), (1,))
        )
        del old
        for owner, name, t in refs:
            itemsize = t.element_size()
            view = torch.empty(0, dtype=t.dtype).set_(
                new_storage, (start // itemsize) + t.storage_offset(), t.size(), t.stride()
            )
            if isinstance(t, nn.Parameter):
                t.data = view
            elif isinstance(owner, dict):
                owner[name] = view
            else:
                setattr(owner, name, view)
        moved += sizes[key]
        del refs
    logger.debug("moved %.1f MB of weights into huge pages", moved / 1e6)
    return moved
