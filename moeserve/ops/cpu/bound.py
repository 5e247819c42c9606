"""Kernel calls with their weight-side arguments derived once, for decode steps.

A decode step calls the same projections and expert layers with the same weights every step,
a few rows at a time; deriving the weight's pointer, strides and ISA choice once leaves one
ctypes call and the checks on the rows. :class:`BoundGemm` is that for the few-row GEMMs of
every weight format (they share one argument list); the formats' ``bind_moe`` objects
(:class:`BoundExperts`) do the same for the one-call MoE kernels over :class:`MoEBuffers`.

A bound call keeps each tensor whose address it uses in ``pointers`` with that address, so its
owner can see a moved weight (``p.data`` replaced, huge pages) and bind again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat
from operator import is_
from typing import Protocol

import torch
from torch import nn

Pointers = tuple[tuple[torch.Tensor, int], ...]


def pointers(*tensors: torch.Tensor) -> Pointers:
    """Each tensor with its current address."""
    return tuple((t, t.data_ptr()) for t in tensors)


_DATA_PTR = torch.Tensor.data_ptr


class Guard:
    """What the owner of prebound calls checks before it uses them again, as flat lists one
    check covers for many owners: each ``(obj, name, value)`` of ``same`` says attribute
    ``name`` of ``obj`` must still be ``value`` (the same object, read where it lived when
    the guard was made: ``obj.__dict__`` or a module's registry of parameters, buffers or
    submodules; gone from there, the guard fails), each tensor of ``bound`` must still be at
    its address.

    The decode stack checks every layer's at once (``models/decode_stack.py``): between two
    weight streams the caches are cold, and the layers' own checks one by one
    (``decode_calls()``, ``bound()``: a method call, ``nn.Module.__getattr__`` and a
    generator each) took ~0.22 ms a step of the benchmark model at int4, :meth:`holds`
    ~0.1 ms (its loops in C, ``map``; what is left is mostly cache misses on the ~320
    tensors)."""

    __slots__ = ("objs", "names", "values", "dicts", "tensors", "ptrs")

    def __init__(self, same: Iterable[tuple[object, str, object]] = (), bound: Pointers = ()):
        same = tuple(same)
        self.objs = [o for o, _, _ in same]
        self.names = [n for _, n, _ in same]
        self.values = [v for _, _, v in same]
        # where each attribute lives: the object's __dict__, or the registry of a module's
        # parameters, buffers or submodules (read there, without nn.Module.__getattr__)
        self.dicts = list(map(_home, self.objs, self.names))
        seen: set[tuple[int, int]] = set()
        self.tensors: list[torch.Tensor] = []
        self.ptrs: list[int] = []
        for t, p in bound:  # a tensor many calls read (the rope tables) checked once
            if (id(t), p) not in seen:
                seen.add((id(t), p))
                self.tensors.append(t)
                self.ptrs.append(p)

    @staticmethod
    def join(guards: Iterable[Guard]) -> Guard:
        """One guard that holds where each of ``guards`` holds."""
        guards = list(guards)
        same = [item for g in guards for item in zip(g.objs, g.names, g.values)]
        return Guard(same, tuple(p for g in guards for p in zip(g.tensors, g.ptrs)))

    def holds(self) -> bool:
        """Whether every attribute is still its recorded object and every tensor at its
        address (an attribute gone: False)."""
        got = map(dict.get, self.dicts, self.names, repeat(_GONE))
        return all(map(is_, got, self.values)) and list(map(_DATA_PTR, self.tensors)) == self.ptrs


_GONE = object()  # what Guard.holds reads for an attribute no longer where it lived


def _home(obj: object, name: str) -> dict:
    """The dict that holds attribute ``name`` of ``obj`` now (``obj.__dict__`` for plain
    attributes, ``_parameters``, ``_buffers`` or ``_modules`` for a module's registered
    ones). Raises AttributeError where there is none."""
    if name in obj.__dict__:
        return obj.__dict__
    if isinstance(obj, nn.Module):
        for d in (obj._parameters, obj._buffers, obj._modules):
            if name in d:
                return d
    raise AttributeError(f"{type(obj).__name__} has no attribute {name!r} to guard")


def calls_guard(calls, same: Iterable[tuple[object, str, object]] = ()) -> Guard:
    """The guard of decode calls (``mla_decode``, ``moe_decode``, ``mlp_decode``) that their
    owner binds, ``same`` being the owner's attributes its ``decode_calls()`` compares:
    besides those, the calls still bound to the same rows (``raw_rows``: made again by
    ``rows()``, emptied when another row count prepares new buffers) and every bound tensor
    at its address."""
    return Guard((*same, (calls, "raw_rows", calls.raw_rows)), calls.pointers)


def on_cpu_contiguous(*tensors: torch.Tensor) -> bool:
    """Whether every tensor lies contiguous on the CPU (what the bound MoE calls read)."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def few_rows(x: torch.Tensor, max_rows: int) -> bool:
    """Whether ``x`` is what the row kernels take: ``[M, K]`` fp32 on the CPU,
    0 < M <= ``max_rows``, unit-stride rows."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= max_rows
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.stride(1) == 1
    )


class BoundGemm:
    """``x @ w.T`` for fp32 decode rows through ``fn(M, N, K, x, ldx, *w_args, out, ldo,
    wide)``, the argument list every few-row GEMM kernel here shares (a nonzero return: its
    workspace could not be allocated). Rows the kernel does not take (more than
    ``max_rows``, another dtype or layout) go to ``fallback(x)``, the format's reference
    dispatch."""

    def __init__(
        self,
        fn,
        shape: tuple[int, int],
        w_args: tuple,
        max_rows: int,
        wide: int,
        bound: Pointers,
        fallback: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.fn, (self.N, self.K) = fn, shape
        self.w_args, self.max_rows, self.wide = w_args, max_rows, wide
        self.pointers = bound
        self.fallback = fallback

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` (into ``out``, fp32 unit-stride rows, when given)."""
        if not few_rows(x, self.max_rows):
            y = self.fallback(x)
            return y if out is None else out.copy_(y)
        M = x.shape[0]
        if out is None:
            out = torch.empty(M, self.N, dtype=torch.float32)
        failed = self.fn(
            M, self.N, self.K, x.data_ptr(), x.stride(0), *self.w_args,
            out.data_ptr(), out.stride(0), self.wide,
        )  # fmt: skip
        if failed:  # the AMX calls allocate their packed rows (the others return nothing)
            raise MemoryError(f"projection of {M} rows: out of memory for its workspace")
        return out

    def call_args(self, x: torch.Tensor, out: torch.Tensor) -> tuple | None:
        """``fn``'s arguments for the rows ``x`` into ``out`` (``[M, N]`` fp32, unit-stride
        rows), for a caller that keeps both where they are and makes the call itself (a nonzero
        return: out of memory); None where the kernel does not take ``x``."""
        if not few_rows(x, self.max_rows):
            return None
        M = x.shape[0]
        return (M, self.N, self.K, x.data_ptr(), x.stride(0), *self.w_args,
                out.data_ptr(), out.stride(0), self.wide)  # fmt: skip


@dataclass(eq=False)
class MoEBuffers:
    """A decode step's rows sorted by expert (``moe_sort.c``), reused by every step with the
    same row count: ``meta [3, R]`` (expert, first row, rows of each group), the source token
    and routing weight of each row, the rows ``x_sorted [R, D]``, a hidden ``h [R, 2F]`` and
    the weighted expert outputs ``y_sorted [R, D]``; ``num_slots`` expert slots; ``tokens``
    the step's token rows, which bound each expert's rows (a kernel may choose by them)."""

    R: int
    D: int
    F: int
    num_slots: int
    tokens: int
    meta: torch.Tensor
    token: torch.Tensor
    weight: torch.Tensor
    x_sorted: torch.Tensor
    h: torch.Tensor
    y_sorted: torch.Tensor

    @staticmethod
    def empty(R: int, D: int, F: int, num_slots: int, tokens: int | None = None) -> MoEBuffers:
        f32 = dict(dtype=torch.float32)
        return MoEBuffers(
            R, D, F, num_slots, R if tokens is None else tokens,
            meta=torch.empty(3, R, dtype=torch.int64),
            token=torch.empty(R, dtype=torch.int64),
            weight=torch.empty(R, **f32),
            x_sorted=torch.empty(R, D, **f32),
            h=torch.empty(R, 2 * F, **f32),
            y_sorted=torch.empty(R, D, **f32),
        )  # fmt: skip

    @property
    def padded_rows(self) -> int:
        """Rows once the AMX calls pad each expert's rows to 16: at most 15 more per expert."""
        return self.R + 15 * min(self.R, self.num_slots)

    def group_args(self) -> tuple:
        """``(expert, first row, rows) pointers, D, F, x_sorted``: how the one-call MoE
        kernels take the groups."""
        m = self.meta
        return (m[0].data_ptr(), m[1].data_ptr(), m[2].data_ptr(), self.D, self.F,
                self.x_sorted.data_ptr())  # fmt: skip


@dataclass(frozen=True, eq=False)
class BoundHeadGemm:
    """``x[h] @ w[h].T`` for every head through ``fn(H, M, N, K, x, ldx_h, ldx_m, *w_args,
    out, ldo_h, ldo_m, wide)``, the argument list the per-head kernels share (a nonzero
    return: a failed allocation), with the weight ``w [H, N, K]`` bound: ``w_args`` its
    pointers and strides as the kernel takes them, ``pointers`` the tensors behind them."""

    fn: object
    w: object
    w_args: tuple
    wide: int
    pointers: Pointers

    @staticmethod
    def dense(fn, w_HNK: torch.Tensor, wide: int) -> BoundHeadGemm:
        """The call of a kernel that takes a dense weight as ``(w, ldw_h, ldw_n)``."""
        w_args = (w_HNK.data_ptr(), w_HNK.stride(0), w_HNK.stride(1))
        return BoundHeadGemm(fn, w_HNK, w_args, wide, pointers(w_HNK))


class BoundExperts(Protocol):
    """A format's one-call MoE kernel with its weights bound: ``prepare(buffers)`` once per
    row count, then ``run(G)`` computes the ``G`` groups of the sorted rows into (and
    returns) the weighted outputs ``[R, D]``. At most ``max_rows`` token rows a step."""

    max_rows: int
    pointers: Pointers

    def prepare(self, buffers: MoEBuffers) -> None: ...

    def run(self, G: int) -> torch.Tensor: ...

    def call_args(self) -> tuple | None:
        """``(fn, args, y)`` where ``run(G)`` is the one call ``fn(G, *args)`` (its return
        unchecked) writing ``y`` (what ``run`` returns): a call chain makes it
        (``ops/cpu/chain.py``); None where ``run`` does more."""
        ...
