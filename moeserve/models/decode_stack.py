"""A stage's decoder layers run for a decode step as chains of prebound kernel calls.

Shape legend: T decode rows, D model dim.

``DecoderLayer.forward`` is ``h = h + attn(norm1(h)); h = h + mlp(norm2(h))``. For a step of
decodes only, :class:`DecodeStack` runs the same arithmetic without the modules, on the
buffers of :class:`~moeserve.ops.cpu.residual.ResidualRows`::

    x = norm1_0(h)
    for each layer i:
        y = attention(x)        MLADecodeCalls' calls, bound to x and y; else the module
        h += y; x = norm2_i(h)                                    one call
        y = mlp(x)              MoEDecodeCalls' or GatedMLPDecodeCalls' calls, bound to x
                                and y; else the module
        h += y; x = norm1_i+1(h)                                  one call (no norm after the last)

The bound calls of consecutive sublayers form one call chain (``ops/cpu/chain.py``), made
from C in one ctypes call with this step's positions, cache slots and block table as its
registers; a sublayer that runs as its module (another attention, EP or TP, weights no kernel
takes, calls switched off by ``use_decode_calls(False)``) or from Python (experts whose
``run`` is more than one call) sits between two chains. The program is made once and again
only when a layer's calls, a norm, the row count or a call's buffers change: what the layers'
own checks compare, they also hand over as one flat guard (``ops/cpu/bound.py: Guard``),
checked at the start of each step in place of those checks. The benchmark model's step
is one chain (its dense first layer's MLP included).

The numbers are the layers', bit for bit: the same kernels in the same order (the adds are
torch's, one rounding each). What it saves is the Python and torch around the kernels: after
each weight stream the caches are cold, and every module call, torch op and allocation
between two kernels then took 10-30 us (a tensor add 6, ``torch.empty`` 20, a module call
that does nothing 12, against 3 for a ctypes call with its arguments ready and ~0.1 in a
chain; measured on the benchmark model's host), ~200 us a layer in all (docs/benchmarks.md).

It steps aside (returns None, and the layers run as modules) where anything would differ:
prefill rows in the step, more rows than the kernels take, no kernels, a norm without its
kernel, or a hook on a module it would skip (the layers, their norms, and the sublayers it runs
as calls; also torch's global module hooks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.ops.cpu.bound import Guard
from moeserve.ops.cpu.chain import NEGATIVE, CallChain, ChainError, Register
from moeserve.ops.cpu.mla_decode import steps_ok
from moeserve.ops.cpu.residual import ResidualRows


class DecodeStack:
    """The decode step of ``layers`` (``DecoderLayer``s: ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``) as in the module docstring."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        skipped = [
            m
            for layer in self.layers
            for m in (layer, layer.input_layernorm, layer.post_attention_layernorm)
        ]
        sublayers = [m for layer in self.layers for m in (layer.self_attn, layer.mlp)]
        # hooks on a sublayer matter only when its calls run in its place; checking them
        # always is simpler and costs the same
        self._hooks = [
            d for m in skipped + sublayers for d in (m._forward_hooks, m._forward_pre_hooks)
        ]
        self._attn = [getattr(layer.self_attn, "decode_calls", None) for layer in self.layers]
        self._mlp = [getattr(layer.mlp, "whole_decode_calls", None) for layer in self.layers]
        # what the calls above check (decode_guard), for all layers at once: sublayers
        # without calls always run as modules and have nothing to check
        self._guards = [
            m.decode_guard
            for layer in self.layers
            for m in (layer.self_attn, layer.mlp)
            if hasattr(m, "decode_guard")
        ]
        self.rows: ResidualRows | None = None
        # the step's program (_program) and what it was made for
        self._key: tuple | None = None
        self._bound: list = []
        self._parts: list = []
        self._mlps: list = []
        # holds while nothing the last step's checks saw has changed (ops/cpu/bound.py)
        self._guard: Guard | None = None

    def hooked(self) -> bool:
        """Whether a forward hook would miss a call the stack skips."""
        return (
            any(self._hooks)
            or bool(torch_module._global_forward_hooks)
            or bool(torch_module._global_forward_pre_hooks)
        )

    def __call__(
        self, positions_T: torch.Tensor, h_TD: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The layers' output ``[T, D]`` for the residual ``h_TD`` of a step of T decodes (a
        new tensor); None, having done nothing, where the stack steps aside."""
        T = h_TD.shape[0]
        slots_T = meta.slot_mapping_T
        if not (meta.num_decodes == T and ResidualRows.usable(h_TD)):
            return None
        step = meta.decode_kernel_args
        if step is None or not steps_ok(positions_T, slots_T) or self.hooked():
            return None
        r = self.rows
        if r is None or r.T != T or r.D != h_TD.shape[1]:
            r = self.rows = ResidualRows(T, h_TD.shape[1])
            self._guard = None
        if self._guard is not None and self._guard.holds():
            program, mlps = self._parts, self._mlps  # nothing changed since the last step
        else:
            made = self._make(r)
            if made is None:
                return None
            program, mlps = made
        r.h.copy_(h_TD)
        registers = (positions_T.data_ptr(), slots_T.data_ptr(), *step)
        for part in program:
            if isinstance(part, tuple):  # a sublayer as its module, or its calls from Python
                kind, i, norm = part
                if kind == "attention":
                    y_TD = _rows(self.layers[i].self_attn(positions_T, r.x, meta), r)
                elif kind == "mlp":
                    y_TD = _rows(self.layers[i].mlp(r.x), r)
                else:  # MoE calls whose experts make more than one call
                    mlps[i].run()
                    y_TD = None
                r.add(y_TD, norm)
            else:
                _run(part, registers)
        return r.h.clone()

    def _make(self, r: ResidualRows) -> tuple[list, list] | None:
        """Every layer's norms and calls checked against their tensors (each layer's own
        checks), the step's program made again where they changed, and the guard that says
        next step whether anything did: ``(program, MLP calls)``; None where a norm has no
        kernel."""
        self._guard = None
        norms = [m.bound() for layer in self.layers for m in self._norms(layer)]
        if None in norms:
            return None
        norms.append(None)  # after the last layer: the add alone
        attns = [None if f is None else f() for f in self._attn]
        mlps = [None if f is None else f() for f in self._mlp]
        program = self._program(attns, mlps, norms, r)
        guards = [m.bound_guard() for layer in self.layers for m in self._norms(layer)]
        guards += [f() for f in self._guards]
        self._guard, self._mlps = Guard.join(guards), mlps
        return program, mlps

    @staticmethod
    def _norms(layer: nn.Module) -> tuple[nn.Module, nn.Module]:
        return layer.input_layernorm, layer.post_attention_layernorm

    def _program(self, attns: list, mlps: list, norms: list, r: ResidualRows) -> list:
        """The step as call chains and the sublayers between them that run from Python; made
        again when a layer's calls, a norm or the buffers changed, or a call no longer runs
        on the buffers (``rows``: another row count went through it)."""
        key = (r, tuple(attns), tuple(mlps), tuple(norms))
        if key == self._key and all(c.bound_rows() == r.key for c in self._bound):
            return self._parts
        parts, bound, c = [], [], CallChain()

        def sublayer(kind: str, i: int, norm) -> None:
            nonlocal c
            if len(c):
                parts.append(c.build())
                c = CallChain()
            parts.append((kind, i, norm))

        r.chain_norm(c, norms[0])
        for i in range(len(self.layers)):
            attn, mlp = attns[i], mlps[i]
            if attn is not None and attn.rows(r.x, r.y):
                attn.chain(c, Register(0), Register(1), tuple(Register(j) for j in range(2, 6)))
                r.chain_add(c, norms[2 * i + 1])
                bound.append(attn)
            else:
                sublayer("attention", i, norms[2 * i + 1])
            if mlp is not None and mlp.rows(r.x, r.y):
                bound.append(mlp)
                if mlp.chain(c):
                    r.chain_add(c, norms[2 * i + 2])
                else:
                    sublayer("mlp calls", i, norms[2 * i + 2])
            else:
                sublayer("mlp", i, norms[2 * i + 2])
        if len(c):
            parts.append(c.build())
        self._key, self._bound, self._parts = key, bound, parts
        return parts


def _run(chain, registers: tuple) -> None:
    """Run a chain of the step; a failed call raises as the layers' calls do (MemoryError for
    a kernel out of scratch memory, RuntimeError for the sort's broken invariant)."""
    try:
        chain.run(*registers)
    except ChainError as e:
        if e.check == NEGATIVE:
            raise RuntimeError(f"decode step: {e.name}: an expert id outside the slots") from e
        raise MemoryError(f"decode step: {e.name}: out of memory for its scratch") from e


def _rows(y_TD: torch.Tensor, r: ResidualRows) -> torch.Tensor:
    """A sublayer module's output as the residual call takes it: ``[T, D]`` fp32, unit-stride
    rows."""
    if y_TD.shape != (r.T, r.D):
        raise ValueError(f"a sublayer returned {tuple(y_TD.shape)} for {r.T} rows of {r.D}")
    if y_TD.dtype != torch.float32 or y_TD.stride(1) != 1:
        y_TD = y_TD.float().contiguous()
    return y_TD
