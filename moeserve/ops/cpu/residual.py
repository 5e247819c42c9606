"""The residual stream of a decode step's decoder layers: the add and the next norm in one call.

Shape legend: T decode rows, D model dim.

A decoder layer adds each sublayer's output ``y`` to the residual ``h`` and normalizes the sum
for the next sublayer: ``h += y; x = rms_norm(h)``. ``fp32.c``'s ``moeserve_add_rms_norm`` does
both for few fp32 rows, with the numbers of ``h + y`` and the norm kernel
(``moeserve_rms_norm``), bit for bit. :class:`ResidualRows` holds a step's ``h``, ``x`` and
``y`` buffers and makes that call by address: the decode stack (``models/decode_stack.py``)
runs the whole step on them. :func:`add_rms_norm` is the call on tensors (tests), and
:func:`add_rms_norm_ref` its reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu.chain import CallChain
from moeserve.ops.cpu.fp32 import BoundRMSNorm


def add_rms_norm(
    h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> torch.Tensor | None:
    """``h += y`` in place, then RMSNorm of ``h`` with ``weight`` into a new tensor (returned),
    for few fp32 rows ``[T, D]`` with unit-stride rows. No ``y``: the norm alone; no
    ``weight``: the add alone (``h`` returned). None, having done nothing, where the kernel
    does not apply."""
    operands = [t for t in (h, y, weight) if t is not None]
    if not (
        fp32_kernels.available()
        and fp32_kernels.few_rows(h)
        and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in operands)
        and (y is None or (y.shape == h.shape and y.stride(1) == 1))
        and (weight is None or (weight.shape == h.shape[1:] and weight.is_contiguous()))
    ):
        return None
    T, D = h.shape
    out = None if weight is None else torch.empty(T, D, dtype=torch.float32)
    fp32_kernels._library().moeserve_add_rms_norm(
        T, D, h.data_ptr(), h.stride(0),
        None if y is None else y.data_ptr(), 0 if y is None else y.stride(0),
        None if weight is None else weight.data_ptr(), eps,
        None if out is None else out.data_ptr(), D,
    )  # fmt: skip
    return h if out is None else out


def add_rms_norm_ref(
    h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Reference of :func:`add_rms_norm`: ``h += y``, then ``F.rms_norm`` (the RMSNorm layer's
    reference path)."""
    if y is not None:
        h += y
    return h if weight is None else F.rms_norm(h, weight.shape, weight, eps)


class ResidualRows:
    """A decode step's buffers for ``T`` rows: the residual ``h``, the normed rows ``x`` a
    sublayer reads and ``y`` for its output, ``[T, D]`` fp32 each, reused by every step of
    that size. ``key`` (``(T, x address, y address)``) is what a sublayer's calls bind to."""

    def __init__(self, T: int, D: int) -> None:
        f32 = dict(dtype=torch.float32)
        self.T, self.D = T, D
        self.h, self.x, self.y = (torch.empty(T, D, **f32) for _ in range(3))
        self.key = (T, self.x.data_ptr(), self.y.data_ptr())
        self._fn = fp32_kernels._library().moeserve_add_rms_norm
        self._h = (T, D, self.h.data_ptr(), D)
        self._x = (self.x.data_ptr(), D)
        self._y = (self.y.data_ptr(), D)

    @staticmethod
    def usable(h_TD: torch.Tensor) -> bool:
        """Whether the call takes the residual ``h_TD`` of a step: fp32 rows on the CPU, no more
        than the norm kernel takes (``fp32.MAX_ROWS``)."""
        return (
            fp32_kernels.available()
            and fp32_kernels.few_rows(h_TD, fp32_kernels.MAX_ROWS)
            and h_TD.is_contiguous()
        )

    def add(self, y_TD: torch.Tensor | None, norm: BoundRMSNorm | None) -> None:
        """``h += y`` (``y_TD``: a sublayer's output; None: the ``y`` buffer), then ``x =
        norm(h)`` (no norm: the add alone, after the last layer). ``y_TD`` must be ``[T, D]``
        fp32 with unit-stride rows."""
        y = self._y if y_TD is None else (y_TD.data_ptr(), y_TD.stride(0))
        self._fn(*self._args(y, norm))

    def chain_norm(self, c: CallChain, norm: BoundRMSNorm) -> None:
        """Add ``x = norm(h)`` (the first layer's input, once ``h`` holds the step's rows) to
        the call chain ``c``."""
        c.add(self._fn, self._args((None, 0), norm), name="residual norm")

    def chain_add(self, c: CallChain, norm: BoundRMSNorm | None) -> None:
        """Add :meth:`add` of the ``y`` buffer to the call chain ``c``."""
        c.add(self._fn, self._args(self._y, norm), name="residual add")

    def _args(self, y: tuple, norm: BoundRMSNorm | None) -> tuple:
        if norm is None:
            return (*self._h, *y, None, 0.0, None, 0)
        return (*self._h, *y, norm.ptr, norm.eps, *self._x)
