"""Switch a freshly built model to a weight format (``ops/formats``) before its checkpoint is
loaded.

What a format converts (int8 and w8a8_int8: per output row, :mod:`moeserve.quant.int8`; int4:
per group of columns, :mod:`moeserve.quant.int4`; bf16: each weight held in bf16, rounded to
nearest as it is loaded, lossless for a bf16 checkpoint):

    every Linear (attention and MLA projections, dense and shared-expert MLPs, the shared
    expert gate, MTP projections and heads), the routed experts' w13 and w2, the LM head

What stays in the model dtype: the router (gate) logits, embeddings (and an LM head tied to
them), norms, biases. MLA derives its absorbed decode weights from the dequantized
``kv_b_proj`` after loading (``layers/mla.py``, held as the format wants them).

The parameters are replaced while still untouched ``torch.empty`` storage (not resident), so
no full-precision copy of the model is ever held; the loaders then convert each tensor's rows
as they arrive (``Int8Tensor.copy_`` quantizes; a bf16 parameter's ``copy_`` rounds).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moeserve.layers.embedding import ParallelLMHead
from moeserve.layers.linear import Linear
from moeserve.layers.moe import FusedExperts
from moeserve.ops import formats
from moeserve.ops.formats.base import WeightFormat
from moeserve.quant.int4 import Int4Weight


def format_targets(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """``(module, parameter name)`` of every weight a format converts."""
    for module in model.modules():
        if isinstance(module, Linear):
            yield module, "weight"
        elif isinstance(module, FusedExperts):
            yield module, "w13_EFD"
            yield module, "w2_EDF"
        elif isinstance(module, ParallelLMHead) and not module.tied:
            yield module, "weight"


def apply_weight_format(
    model: nn.Module, name: str | WeightFormat | None, keep_lm_head: bool = False
) -> int:
    """Put the format's empty weight (``WeightFormat.make_weight``; ``name``: a registered
    name or a configured format, ``formats.configured``) in place of each still-empty
    parameter of :func:`format_targets` (but the LM head's with ``keep_lm_head``: an AWQ or
    GPTQ checkpoint that keeps it 16-bit); returns how many were replaced (0 for None, the
    model dtype). Call before loading the checkpoint."""
    if name is None:
        return 0
    fmt = formats.get(name) if isinstance(name, str) else name
    targets = [
        (m, attr)
        for m, attr in format_targets(model)
        if isinstance(getattr(m, attr), nn.Parameter)
        and not (keep_lm_head and isinstance(m, ParallelLMHead))
    ]
    names = {id(m): n for n, m in model.named_modules()}
    for module, attr in targets:
        p = getattr(module, attr)
        try:
            w = fmt.make_weight(p)
        except ValueError as e:  # a shape the format cannot hold: name the weight
            raise ValueError(f"{names.get(id(module), '?')}.{attr}: {e}") from None
        delattr(module, attr)
        setattr(module, attr, w)
    return len(targets)


def settle_int4(model: nn.Module) -> None:
    """After loading a GPTQ act-order checkpoint: fold each expert's ``w2`` column order into
    its ``w13`` rows (the activation is elementwise, so gate and up rows in ``w2``'s order
    give ``h`` in that order), then forget every column order that is the identity. What
    stays is gathered from x per GEMM (``ops/formats/int4.py``). Nothing to do otherwise."""
    for module in model.modules():
        if isinstance(module, FusedExperts):
            _fold_down_order(module.w13_EFD, module.w2_EDF)
    for module, attr in format_targets(model):
        w = getattr(module, attr)
        if isinstance(w, Int4Weight):
            w.drop_identity_order()


def _fold_down_order(w13, w2) -> None:
    if not (isinstance(w13, Int4Weight) and isinstance(w2, Int4Weight)) or w2.perm is None:
        return
    F = w2.shape[-1]
    identity = torch.arange(F, dtype=w2.perm.dtype)
    for s in range(w2.perm.shape[0]):
        order = w2.perm[s]
        if torch.equal(order, identity):
            continue
        rows = order.long()
        for half in (slice(0, F), slice(F, 2 * F)):
            for t in (w13.q, w13.scale, w13.zero):
                t[s, half] = t[s, half][rows]
        order.copy_(identity)
