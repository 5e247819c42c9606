"""A stage's decoder layers run for a decode step as one loop of prebound calls.

Shape legend: T decode rows, D model dim.

``DecoderLayer.forward`` is ``h = h + attn(norm1(h)); h = h + mlp(norm2(h))``. For a step of
decodes only, :class:`DecodeStack` runs the same arithmetic without the modules, on the
buffers of :class:`~moeserve.ops.cpu.residual.ResidualRows`::

    x = norm1_0(h)
    for each layer i:
        y = attention(x)        MLADecodeCalls.run, bound to x and y; else the module
        h += y; x = norm2_i(h)                                    one call
        y = mlp(x)              MoEDecodeCalls.run, bound to x and y; else the module
        h += y; x = norm1_i+1(h)                                  one call (no norm after the last)

The numbers are the layers', bit for bit: the same kernels in the same order (the adds are
torch's, one rounding each). What it saves is the Python and torch around the kernels: after
each weight stream the caches are cold, and every module call, torch op and allocation
between two kernels then took 10-30 us (a tensor add 6, ``torch.empty`` 20, a module call
that does nothing 12, against 3 for a ctypes call with its arguments ready; measured on the
benchmark model's host), ~200 us a layer in all (docs/benchmarks.md).

It steps aside (returns None, and the layers run as modules) where anything would differ:
prefill rows in the step, more rows than the kernels take, no kernels, a norm without its
kernel, or a hook on a module it would skip (the layers, their norms, and the sublayers it runs
as calls; also torch's global module hooks). A sublayer without calls (a dense MLP, another
attention, EP or TP, calls switched off by ``use_decode_calls(False)``) runs as its module on
``x``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from moeserve.layers.attention_meta import AttentionMetadata
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
        self.rows: ResidualRows | None = None

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
        norms = []
        for layer in self.layers:
            norms += [layer.input_layernorm.bound(), layer.post_attention_layernorm.bound()]
        if None in norms:
            return None
        norms.append(None)  # after the last layer: the add alone
        r = self.rows
        if r is None or r.T != T or r.D != h_TD.shape[1]:
            r = self.rows = ResidualRows(T, h_TD.shape[1])
        # every layer's calls, checked against their tensors now, in one loop that stays in
        # cache (between two weight streams each check cost ~20 us, ~0.4 ms a step)
        attns = [None if f is None else f() for f in self._attn]
        mlps = [None if f is None else f() for f in self._mlp]
        pos, slots = positions_T.data_ptr(), slots_T.data_ptr()
        r.start(h_TD, norms[0])
        for i, layer in enumerate(self.layers):
            attn = attns[i]
            if attn is not None and (attn.bound_rows() == r.key or attn.rows(r.x, r.y)):
                attn.run(pos, slots, step)
                r.add(None, norms[2 * i + 1])
            else:
                r.add(_rows(layer.self_attn(positions_T, r.x, meta), r), norms[2 * i + 1])
            mlp = mlps[i]
            if mlp is not None and (mlp.bound_rows() == r.key or mlp.rows(r.x, r.y)):
                mlp.run()
                r.add(None, norms[2 * i + 2])
            else:
                r.add(_rows(layer.mlp(r.x), r), norms[2 * i + 2])
        return r.h.clone()


def _rows(y_TD: torch.Tensor, r: ResidualRows) -> torch.Tensor:
    """A sublayer module's output as the residual call takes it: ``[T, D]`` fp32, unit-stride
    rows."""
    if y_TD.shape != (r.T, r.D):
        raise ValueError(f"a sublayer returned {tuple(y_TD.shape)} for {r.T} rows of {r.D}")
    if y_TD.dtype != torch.float32 or y_TD.stride(1) != 1:
        y_TD = y_TD.float().contiguous()
    return y_TD
