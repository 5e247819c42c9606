"""The routed experts of one MoE layer's decode step as prebound kernel calls.

Shape legend: T tokens, D model dim, F expert FFN dim, E logical experts, K choices per token
(top-k, plus the folded shared expert's slot), R = T * K sorted rows, G groups (experts with
rows).

Per step: the router logits (the gate's bound GEMM), DeepSeek's grouped sigmoid routing
(``fp32.c``, the choices counted), the pairs sorted by expert and gathered
(``moe_sort.c``), the format's one-call MoE kernel (:class:`~moeserve.ops.cpu.bound.
BoundExperts`), the rows added back per token. Every argument is derived when the row count
changes, so a step is five ctypes calls. ``ops/moe.py: moe_grouped`` (with the router's torch
routing) is the reference and runs where this does not apply; the two agree bit for bit.
As with ``mla_decode.py``, the decode stack binds the calls to its buffers once
(:meth:`MoEDecodeCalls.rows`) and adds them to a call chain (:meth:`MoEDecodeCalls.chain`), or
runs them from Python (:meth:`MoEDecodeCalls.run`) where the experts make more than one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu import moe_sort
from moeserve.ops.cpu.bound import BoundExperts, MoEBuffers, Pointers, pointers
from moeserve.ops.cpu.chain import NEGATIVE, NONE, CallChain, Result


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3's routing constants (``noaux_tc``): sigmoid scores, ``top_k`` of
    ``num_experts`` within the ``topk_group`` best of ``n_group`` groups."""

    num_experts: int
    n_group: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool
    scaling: float

    def kernel_ok(self) -> bool:
        """Whether the routing kernel takes these constants."""
        E = self.num_experts
        return (
            E <= 1024
            and self.n_group <= 256
            and self.top_k <= self.topk_group * (E // self.n_group)
        )


class MoEDecodeCalls:
    """Few fp32 rows through routing, sort, the bound experts and combine (module docstring).
    ``gate(x, out)`` is the router's bound projection (``[T, D]`` -> ``[T, E]`` logits);
    ``bias_E`` the correction bias or None; ``counts_E`` (int64) gains one per routed choice;
    ``extra`` is the slot every token also goes to at weight 1 (the folded shared expert), or
    -1."""

    def __init__(
        self,
        gate,
        routing: GroupedRouting,
        bias_E: torch.Tensor | None,
        counts_E: torch.Tensor,
        experts: BoundExperts,
        num_slots: int,
        D: int,
        F: int,
        extra: int,
    ) -> None:
        r = routing
        self.gate, self.experts = gate, experts
        self.num_slots, self.D, self.F, self.extra = num_slots, D, F, extra
        self.K = r.top_k + (extra >= 0)
        self.route_fn = fp32_kernels._library().moeserve_route_grouped_sigmoid
        self.route_const = (r.num_experts, r.n_group, r.topk_group, r.top_k)
        self.route_mid = (None if bias_E is None else bias_E.data_ptr(), int(r.norm_topk_prob))
        self.route_mid += (r.scaling,)
        self.counts = counts_E
        self.sort_fn = moe_sort._library().moeserve_moe_sort
        self.combine_fn = moe_sort._library().moeserve_moe_combine
        self.max_rows = experts.max_rows
        bound = () if bias_E is None else (bias_E,)
        self.pointers: Pointers = pointers(*bound, counts_E) + experts.pointers + gate.pointers
        self.T = 0  # the row count the buffers below are for
        self.raw: tuple | None = None  # the router's call on the bound rows (rows)
        self.raw_rows: tuple = ()

    @staticmethod
    def bind(
        gate,
        routing: GroupedRouting,
        bias_E: torch.Tensor | None,
        counts_E: torch.Tensor,
        experts: BoundExperts | None,
        w13_shape: tuple[int, int, int],
        extra: int,
    ) -> MoEDecodeCalls | None:
        """The calls, or None where they do not apply: no bound experts (``w13_shape``:
        their ``[S, 2F, D]``) or gate kernel, a bias or counts the kernels do not take,
        routing constants beyond the kernel's bounds, no kernels here."""
        ok = (
            experts is not None
            and gate.kernel is not None
            and (bias_E is None or (bias_E.dtype == torch.float32 and bias_E.is_contiguous()))
            and counts_E.dtype == torch.int64
            and counts_E.is_contiguous()
            and routing.kernel_ok()
            and fp32_kernels.available()
            and moe_sort.available()
        )
        if not ok:
            return None
        S, F2, D = w13_shape
        return MoEDecodeCalls(gate, routing, bias_E, counts_E, experts, S, D, F2 // 2, extra)

    def fresh(self, counts_E: torch.Tensor) -> bool:
        """Whether the weights and ``counts_E`` are still the bound tensors, at the same
        addresses (loading or moving weights into huge pages replaces them)."""
        return counts_E is self.counts and all(t.data_ptr() == p for t, p in self.pointers)

    def _prepare(self, T: int) -> None:
        """Buffers for T rows, reused by every step of that size."""
        R, D = T * self.K, self.D
        self.logits = torch.empty(T, self.route_const[0], dtype=torch.float32)
        self.ids = torch.empty(T, self.K, dtype=torch.int64)
        self.w = torch.empty(T, self.K, dtype=torch.float32)
        b = self.buffers = MoEBuffers.empty(R, D, self.F, self.num_slots, tokens=T)
        # routing: (T, E, groups, top groups, top k, logits, bias, renormalise, scale, ids,
        # weights, counts, extra slot)
        self.route_args = (T, *self.route_const, self.logits.data_ptr(), *self.route_mid)
        self.route_args += (self.ids.data_ptr(), self.w.data_ptr(), self.counts.data_ptr())
        self.route_args += (self.extra,)
        m = b.meta
        self.sort_args = (T, self.K, self.num_slots, self.ids.data_ptr(), self.w.data_ptr())
        self.sort_out = (D, m[0].data_ptr(), m[1].data_ptr(), m[2].data_ptr())
        self.sort_out += (b.token.data_ptr(), b.weight.data_ptr(), b.x_sorted.data_ptr())
        self.experts.prepare(b)
        self.token = b.token.data_ptr()
        self.raw, self.raw_rows = None, ()  # rows must bind again to the new buffers
        self.T = T

    def __call__(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        """The routed (and folded shared) experts' output ``[T, D]`` for few fp32 rows, the
        choices counted; None, having done nothing, where the kernels do not take them."""
        if not fp32_kernels.few_rows(x_TD, self.max_rows):
            return None
        T = x_TD.shape[0]
        if T != self.T:
            self._prepare(T)
        self.gate(x_TD, self.logits)
        G = self._route(x_TD.data_ptr(), x_TD.stride(0))
        y_TD = torch.empty(T, self.D, dtype=torch.float32)
        self._combine(G, y_TD.data_ptr())
        return y_TD

    def rows(self, x_TD: torch.Tensor, y_TD: torch.Tensor) -> bool:
        """Bind :meth:`run` and :meth:`chain` to the rows of ``x_TD`` and to ``y_TD`` for the
        output (both ``[T, D]`` fp32, contiguous, kept where they are by the caller: the
        decode stack's buffers); False where the kernels do not take them."""
        if not (fp32_kernels.few_rows(x_TD, self.max_rows) and y_TD.is_contiguous()):
            return False
        T = x_TD.shape[0]
        if T != self.T:
            self._prepare(T)
        gate = self.gate.kernel.call_args(x_TD, self.logits)
        if gate is None:
            return False
        self.raw = (self.gate.kernel.fn, gate, x_TD.data_ptr(), x_TD.stride(0), y_TD.data_ptr())
        self.raw_rows = (T, x_TD.data_ptr(), y_TD.data_ptr())
        return True

    def bound_rows(self) -> tuple:
        """``(T, x address, y address)`` that :meth:`run` is bound to; empty when it is not."""
        return self.raw_rows

    def run(self) -> None:
        """The step of ``__call__`` on the rows :meth:`rows` bound, ``y_TD`` written."""
        gate_fn, gate, x, ldx, y = self.raw
        if gate_fn(*gate):
            raise MemoryError("MoE decode: out of memory for the router's workspace")
        self._combine(self._route(x, ldx), y)

    def chain(self, c: CallChain) -> bool:
        """Add :meth:`run`'s calls, as :meth:`rows` bound them, to ``c`` (the sort's group
        count passed on to the experts' call); False, having added nothing, where the experts
        do more than one call (their ``call_args`` is None)."""
        experts = self.experts.call_args()
        if experts is None:
            return False
        gate_fn, gate, x, ldx, y = self.raw
        c.add(gate_fn, gate, name="MoE router projection")
        c.add(self.route_fn, self.route_args, name="MoE routing")
        sort = c.add(self.sort_fn, (*self.sort_args, x, ldx, *self.sort_out), NEGATIVE, "MoE sort")
        fn, args, y_RD = experts
        c.add(fn, (Result(sort), *args), NONE, "MoE experts")
        combine = (self.T * self.K, self.T, self.D, y_RD.data_ptr(), self.token, y)
        c.add(self.combine_fn, combine, name="MoE combine")
        return True

    def _route(self, x: int, ldx: int) -> int:
        """Route the logits (choices counted) and sort the rows at ``x`` by expert: the number
        of groups."""
        self.route_fn(*self.route_args)
        G = self.sort_fn(*self.sort_args, x, ldx, *self.sort_out)
        if G < 0:  # the routing kernel only writes ids in [0, E): a broken invariant
            raise RuntimeError(f"MoE decode: an expert id outside [0, {self.num_slots})")
        return G

    def _combine(self, G: int, y: int) -> None:
        """The ``G`` groups through the experts, each token's rows added up in row order (as
        the reference, ``ops/moe.py: combine_rows``) into the ``[T, D]`` rows at ``y``."""
        y_RD = self.experts.run(G)
        self.combine_fn(self.T * self.K, self.T, self.D, y_RD.data_ptr(), self.token, y)
