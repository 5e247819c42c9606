"""Weight quantization applied at load: ``--quantization int8`` (``int8.py`` holds the
format, ``apply.py`` the pass that switches a model's layers to it before loading)."""

from __future__ import annotations

QUANTIZATIONS = ("none", "int8")


def normalize_quantization(name: str | None) -> str | None:
    """None for no quantization, else the method's name; raises ValueError naming the
    choices for an unknown one."""
    if name is None or name == "none":
        return None
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose one of {', '.join(QUANTIZATIONS)}")
    return name
