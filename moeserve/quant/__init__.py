"""Weight formats applied at load (``--quantization``): ``int8`` (weight-only int8,
``int8.py``), ``w8a8_int8`` (the same int8 weights, with every GEMM's input rows quantized to
int8 per token as well: AMX's int8 products, ``ops/cpu/amx_int8.c``) and ``bf16`` (weights
held in bf16, activations fp32: the GEMMs' fast path on CPUs with AMX, ``ops/cpu/amx.c``).
``apply.py`` is the pass that switches a model's layers to a format before loading."""

from __future__ import annotations

QUANTIZATIONS = ("none", "int8", "w8a8_int8", "bf16")
# formats whose CPU kernels take fp32 activation tensors (w8a8_int8 quantizes them inside)
FP32_ACTIVATIONS = ("int8", "w8a8_int8", "bf16")


def normalize_quantization(name: str | None) -> str | None:
    """None for no quantization, else the method's name; raises ValueError naming the
    choices for an unknown one."""
    if name is None or name == "none":
        return None
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose one of {', '.join(QUANTIZATIONS)}")
    return name
