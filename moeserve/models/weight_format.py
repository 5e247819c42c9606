"""Switch a freshly built model to a weight format (``ops/formats``) before its checkpoint is
loaded.

What a format converts (int8 and w8a8_int8: per output row, :mod:`moeserve.quant.int8`; bf16:
each weight held in bf16, rounded to nearest as it is loaded, lossless for a bf16
checkpoint):

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

from torch import nn

from moeserve.layers.embedding import ParallelLMHead
from moeserve.layers.linear import Linear
from moeserve.layers.moe import FusedExperts
from moeserve.ops import formats


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


def apply_weight_format(model: nn.Module, name: str | None) -> int:
    """Put the format ``name``'s empty weight (``WeightFormat.make_weight``) in place of each
    still-empty parameter of :func:`format_targets`; returns how many were replaced (0 for
    None, the model dtype). Call before loading the checkpoint."""
    if name is None:
        return 0
    fmt = formats.get(name)
    targets = [
        (m, attr) for m, attr in format_targets(model) if isinstance(getattr(m, attr), nn.Parameter)
    ]
    for module, attr in targets:
        p = getattr(module, attr)
        delattr(module, attr)
        setattr(module, attr, fmt.make_weight(p))
    return len(targets)
