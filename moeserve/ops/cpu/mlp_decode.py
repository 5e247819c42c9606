"""A gated MLP's decode step (``layers/linear.py: GatedMLP``, a dense layer's FFN) as prebound
kernel calls.

Shape legend: T rows, D model dim, F intermediate dim.

Per step, three ctypes calls and no torch op::

    h = x @ [gate | up]^T           the bound gate/up projection (any weight format), [T, 2F]
    h[:, :F] = silu(gate) * up      fp32.c: moeserve_silu_mul (the MoE kernels' activation)
    y = h[:, :F] @ down^T           the bound down projection, reading rows 2F apart

``GatedMLP.forward`` runs these for the rows they take, so the module and the decode stack
(which binds them to its buffers, :meth:`GatedMLPDecodeCalls.rows`, and adds them to a call
chain, :meth:`GatedMLPDecodeCalls.chain`) give the same bits; more rows run in torch
(``F.silu``, within a few ulps of the kernel's activation).
"""

from __future__ import annotations

import torch

from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu.bound import Pointers
from moeserve.ops.cpu.chain import CallChain


def silu_mul(h: torch.Tensor) -> torch.Tensor | None:
    """A gated MLP's activation for fp32 rows of its hidden ``h [M, 2F]`` (``[gate | up]``,
    unit-stride rows, any M): ``silu(gate) * up`` written over the gate half, which is
    returned (``h[:, :F]``); None, having done nothing, where the kernel does not take ``h``.
    The form of the MoE kernels' activation (``common.h: silu_mul_row``); its reference is
    ``F.silu(gate) * up`` (within a few ulps, not bit for bit)."""
    ok = h.dim() == 2 and h.dtype == torch.float32 and h.device.type == "cpu"
    if not (ok and h.stride(1) == 1 and h.shape[1] % 2 == 0 and fp32_kernels.available()):
        return None
    F = h.shape[1] // 2
    fp32_kernels._library().moeserve_silu_mul(h.shape[0], F, h.data_ptr(), h.stride(0))
    return h[:, :F]


class GatedMLPDecodeCalls:
    """The calls of the module docstring. ``gate_up`` and ``down`` are the bound projections
    (callables ``(x, out)`` with ``w``, ``kernel``, ``max_rows`` and ``pointers``:
    ``ops/linear.py: BoundLinear``) of the ``[2F, D]`` and ``[D, F]`` weights."""

    def __init__(self, gate_up, down, F: int) -> None:
        self.gate_up, self.down, self.F = gate_up, down, F
        self.silu_fn = fp32_kernels._library().moeserve_silu_mul
        self.max_rows = min(gate_up.max_rows, down.max_rows, fp32_kernels.MAX_ROWS)
        self.pointers: Pointers = gate_up.pointers + down.pointers
        self.T = 0  # the row count the hidden below is for
        self.h: torch.Tensor | None = None  # [T, 2F]
        self.raw: tuple | None = None  # the calls on the bound rows (rows)
        self.raw_rows: tuple = ()

    @staticmethod
    def bind(gate_up, down) -> GatedMLPDecodeCalls | None:
        """The calls, or None where they do not apply: a projection without a bound kernel,
        shapes that do not chain (gate/up's outputs twice down's inputs), no kernels here."""
        ok = (
            gate_up.kernel is not None
            and down.kernel is not None
            and gate_up.kernel.N == 2 * down.kernel.K
            and gate_up.kernel.K == down.kernel.N
            and fp32_kernels.available()
        )
        return GatedMLPDecodeCalls(gate_up, down, down.kernel.K) if ok else None

    def fresh(self, w13, w2) -> bool:
        """Whether ``w13`` and ``w2`` are still the bound weights, every bound tensor at the
        same address (loading or moving weights into huge pages replaces them)."""
        return (
            w13 is self.gate_up.w
            and w2 is self.down.w
            and all(t.data_ptr() == p for t, p in self.pointers)
        )

    def _prepare(self, T: int) -> None:
        """The hidden for T rows, reused by every step of that size."""
        self.h = torch.empty(T, 2 * self.F, dtype=torch.float32)
        self.silu_args = (T, self.F, self.h.data_ptr(), 2 * self.F)
        self.raw, self.raw_rows = None, ()  # rows must bind again to the new hidden
        self.T = T

    def __call__(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        """``down(silu(gate(x)) * up(x))`` of few fp32 rows, a new ``[T, D]`` tensor; None,
        having done nothing, where the kernels do not take them."""
        if not fp32_kernels.few_rows(x_TD, self.max_rows):
            return None
        T = x_TD.shape[0]
        if T != self.T:
            self._prepare(T)
        self.gate_up(x_TD, self.h)
        self.silu_fn(*self.silu_args)
        return self.down(self.h[:, : self.F])

    def rows(self, x_TD: torch.Tensor, y_TD: torch.Tensor) -> bool:
        """Bind :meth:`run` and :meth:`chain` to the rows of ``x_TD`` and to ``y_TD`` for the
        output (both ``[T, D]`` fp32 with unit-stride rows, kept where they are by the caller:
        the decode stack's buffers); False where the kernels do not take them."""
        if not fp32_kernels.few_rows(x_TD, self.max_rows):
            return False
        T = x_TD.shape[0]
        if T != self.T:
            self._prepare(T)
        gate_up = self.gate_up.kernel.call_args(x_TD, self.h)
        down = self.down.kernel.call_args(self.h[:, : self.F], y_TD)
        if gate_up is None or down is None:
            return False
        self.raw = (self.gate_up.kernel.fn, gate_up, self.down.kernel.fn, down)
        self.raw_rows = (T, x_TD.data_ptr(), y_TD.data_ptr())
        return True

    def bound_rows(self) -> tuple:
        """``(T, x address, y address)`` that :meth:`run` and :meth:`chain` are bound to; empty
        when they are not (a ``__call__`` of another row count prepares a new hidden)."""
        return self.raw_rows

    def run(self) -> None:
        """The step of ``__call__`` on the rows :meth:`rows` bound, ``y_TD`` written."""
        gate_up_fn, gate_up, down_fn, down = self.raw
        if gate_up_fn(*gate_up):
            raise MemoryError("MLP decode: out of memory for the gate/up projection's workspace")
        self.silu_fn(*self.silu_args)
        if down_fn(*down):
            raise MemoryError("MLP decode: out of memory for the down projection's workspace")

    def chain(self, c: CallChain) -> bool:
        """Add :meth:`run`'s calls, as :meth:`rows` bound them, to ``c``; True (the decode
        stack's MLP calls say whether they chained)."""
        gate_up_fn, gate_up, down_fn, down = self.raw
        c.add(gate_up_fn, gate_up, name="MLP gate/up projection")
        c.add(self.silu_fn, self.silu_args, name="MLP activation")
        c.add(down_fn, down, name="MLP down projection")
        return True
