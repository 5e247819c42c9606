"""Switch a freshly built model to int8 or bf16 weights before its checkpoint is loaded.

What is converted (int8 and w8a8_int8: per output row, :mod:`moeserve.quant.int8`; bf16:
each weight held in bf16, rounded to nearest as it is loaded, lossless for a bf16
checkpoint):

    every Linear (attention and MLA projections, dense and shared-expert MLPs, the shared
    expert gate, MTP projections and heads), the routed experts' w13 and w2, the LM head

What stays in the model dtype: the router (gate) logits, embeddings (and an LM head tied to
them), norms, biases. MLA derives its absorbed fp32 decode weights from the dequantized
``kv_b_proj`` after loading (``layers/mla.py``).

The fp32 parameters are replaced while still untouched ``torch.empty`` storage (not resident),
so no full-precision copy of the model is ever held; the loaders then quantize each tensor's
rows as they arrive (``Int8Tensor.copy_``; a bf16 parameter's ``copy_`` rounds).

Activations stay fp32 under all three (``EngineConfig.torch_dtype``): the norms, rope, routing
and attention keep their fp32 kernels, and only the GEMMs read the narrow weights (under
w8a8_int8 each GEMM also rounds its input rows to int8, per token, inside the call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from moeserve.layers.embedding import ParallelLMHead
from moeserve.layers.linear import Linear
from moeserve.layers.moe import FusedExperts
from moeserve.quant import normalize_quantization
from moeserve.quant.int8 import Int8Weight


def int8_targets(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """``(module, parameter name)`` of every weight :func:`quantize_int8` and
    :func:`to_bf16` convert."""
    for module in model.modules():
        if isinstance(module, Linear):
            yield module, "weight"
        elif isinstance(module, FusedExperts):
            yield module, "w13_EFD"
            yield module, "w2_EDF"
        elif isinstance(module, ParallelLMHead) and not module.tied:
            yield module, "weight"


def _replace_targets(model: nn.Module, make: Callable[[nn.Parameter], nn.Module]) -> int:
    """Put ``make(p)`` in place of each parameter ``p`` of :func:`int8_targets`; how many."""
    targets = [
        (m, name) for m, name in int8_targets(model) if isinstance(getattr(m, name), nn.Parameter)
    ]
    for module, name in targets:
        p = getattr(module, name)
        delattr(module, name)
        setattr(module, name, make(p))
    return len(targets)


def quantize_int8(model: nn.Module, act_int8: bool = False) -> int:
    """Replace the weights of :func:`int8_targets` by empty :class:`Int8Weight` modules of the
    same shape and device (``act_int8``: the w8a8_int8 format); returns how many. Call before
    loading the checkpoint."""
    return _replace_targets(
        model, lambda p: Int8Weight(tuple(p.shape), device=p.device, act_int8=act_int8)
    )


def to_bf16(model: nn.Module) -> int:
    """Replace the weights of :func:`int8_targets` by empty bf16 parameters of the same shape
    and device; returns how many. Call before loading the checkpoint."""

    def bf16(p: nn.Parameter) -> nn.Parameter:
        w = torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)
        return nn.Parameter(w, requires_grad=False)

    return _replace_targets(model, bf16)


def apply_quantization(model: nn.Module, method: str | None) -> None:
    """Prepare ``model`` for loading with ``method`` (None, "none", "int8", "w8a8_int8" or
    "bf16")."""
    method = normalize_quantization(method)
    if method in ("int8", "w8a8_int8"):
        quantize_int8(model, act_int8=method == "w8a8_int8")
    elif method == "bf16":
        to_bf16(model)
