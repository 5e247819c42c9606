"""The weight-format registry: one object per format, found by name or asked of a weight.

    name         module        weights                          activations (CPU)
    fp32         fp32.py       dense fp32                       the model dtype
    bf16         bf16.py       dense bf16 (AMX tiles)           fp32 or bf16
    int8         int8.py       int8 rows, one fp32 scale each   fp32
    w8a8_int8    w8a8_int8.py  int8's, rows of x rounded too    fp32
    int4         int4.py       4-bit codes, a scale and zero    fp32
                               point per group of columns
    w4a8_int8    w4a8_int8.py  int4's, rows of x rounded to     fp32
                               int8 (AMX's int8 tiles)

A weight carries its format: an int8 weight (``quant/int8.py``) names it, a dense tensor's is
its dtype's (fp32, bf16; other dtypes get the plain torch format of ``base.py``). Layers call
:func:`of` (through ``ops/linear.py`` and ``ops/moe.py``) and never test types or dtypes.

Adding a format: one module here defining ``FORMAT`` (a :class:`~moeserve.ops.formats.base.
WeightFormat`; ``docs/architecture.md`` lists what it must provide) and one line in
``_MODULES``. This module imports nothing of moeserve at import time (the formats load on first
use), so the configuration may validate names against it.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moeserve.ops.formats.base import WeightFormat

# name -> module under moeserve/ops/formats that defines FORMAT
_MODULES = {
    "fp32": "fp32",
    "int8": "int8",
    "w8a8_int8": "w8a8_int8",
    "bf16": "bf16",
    "int4": "int4",
    "w4a8_int8": "w4a8_int8",
}
# what --quantization takes: "none" keeps the checkpoint's weights in the model dtype
QUANTIZATIONS = ("none", *(n for n in _MODULES if n != "fp32"))
_DENSE = {torch.float32: "fp32", torch.bfloat16: "bf16"}
INT4_GROUP_SIZES = (32, 64, 128)  # columns per scale int4 takes (ops/formats/int4.py)
INT4_FORMATS = ("int4", "w4a8_int8")  # the formats of int4 weights, which take int4's options


def normalize_quantization(name: str | None) -> str | None:
    """None for no quantization, else the format's name; raises ValueError naming the
    choices for an unknown one."""
    if name is None or name == "none":
        return None
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose one of {', '.join(QUANTIZATIONS)}")
    return name


@cache
def get(name: str) -> WeightFormat:
    """The format called ``name``; KeyError naming the registered ones otherwise."""
    if name not in _MODULES:
        raise KeyError(f"no weight format {name!r}; registered: {', '.join(_MODULES)}")
    return importlib.import_module(f"moeserve.ops.formats.{_MODULES[name]}").FORMAT


def check_options(name: str | None, int4_group_size: int | None, int4_symmetric: bool) -> None:
    """Raise ValueError for int4's options given with a format of other weights, or a group
    size int4 does not take (without loading any format)."""
    if name not in INT4_FORMATS and (int4_group_size is not None or not int4_symmetric):
        raise ValueError(
            "int4_group_size and int4_symmetric apply to the int4 weights of quantization "
            f"{' and '.join(INT4_FORMATS)} only, not {name or 'none'}"
        )
    if int4_group_size is not None and int4_group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"int4_group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
            f"got {int4_group_size}"
        )


def configured(
    name: str | None, int4_group_size: int | None = None, int4_symmetric: bool = True
) -> WeightFormat | None:
    """The format ``name`` quantizing as the options say (None for None). The options are
    int4's (``ops/formats/int4.py``, w4a8_int8's too); ValueError as :func:`check_options`
    says."""
    check_options(name, int4_group_size, int4_symmetric)
    if name is None:
        return None
    fmt = get(name)
    return fmt.configured(int4_group_size, int4_symmetric) if name in INT4_FORMATS else fmt


@cache
def _plain(dtype: torch.dtype) -> WeightFormat:
    from moeserve.ops.formats.base import WeightFormat

    return WeightFormat(str(dtype).removeprefix("torch."))


def of(w) -> WeightFormat:
    """The format of weight ``w``: the one it names, else its dtype's (a float dtype without
    kernels: plain torch). TypeError for a tensor that is no weight (integer values)."""
    name = getattr(w, "weight_format", None)
    if name is not None:
        return get(name)
    dense = _DENSE.get(w.dtype)
    if dense is not None:
        return get(dense)
    if not w.dtype.is_floating_point:
        raise TypeError(f"a {w.dtype} tensor has no weight format (int8 weights are Int8Weight)")
    return _plain(w.dtype)


def resolve(
    quantization: str | None, dtype: str, device: torch.device
) -> tuple[str | None, torch.dtype]:
    """``(format applied at load, model dtype)`` for an engine's settings. ``quantization``
    wins; with ``dtype="auto"`` on a CPU whose bf16 AMX kernels run, bf16 weights (with fp32
    activations: faster than bf16 throughout and closer to fp32, docs/benchmarks.md); else
    None, the checkpoint's weights in the model dtype. With ``dtype="auto"`` on a CPU, a format
    whose kernels take fp32 activations makes the model fp32."""
    from moeserve.platform import cpu_has_fast_bf16, resolve_dtype

    name = normalize_quantization(quantization)
    if name is None and dtype == "auto" and device.type == "cpu" and cpu_has_fast_bf16():
        name = "bf16" if get("bf16").kernels_available() else None
    if dtype == "auto" and device.type == "cpu" and name is not None:
        act = get(name).activation_dtype
        if act is not None:
            return name, act
    return name, resolve_dtype(dtype, device)
