"""Weight formats applied at load (``--quantization``): ``int8`` (weight-only int8,
``int8.py``) and ``bf16`` (weights held in bf16, activations fp32: the GEMMs' fast path on
CPUs with AMX, ``ops/cpu/amx.c``). ``apply.py`` is the pass that switches a model's layers to
a format before loading."""

from __future__ import annotations

QUANTIZATIONS = ("none", "int8", "bf16")
# formats whose weights the CPU kernels multiply with fp32 activations
WEIGHT_ONLY = ("int8", "bf16")


def normalize_quantization(name: str | None) -> str | None:
    """None for no quantization, else the method's name; raises ValueError naming the
    choices for an unknown one."""
    if name is None or name == "none":
        return None
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose one of {', '.join(QUANTIZATIONS)}")
    return name
