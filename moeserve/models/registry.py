"""Architecture name -> model class, imported lazily so a missing backend never breaks import."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# HF "architectures" entry -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV3ForCausalLM": ("moeserve.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("moeserve.models.qwen_moe", "QwenMoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("moeserve.models.qwen_moe", "QwenMoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type[nn.Module]:
    """The model class of a supported ``architecture``; ValueError naming the supported ones
    otherwise (``ModelConfig.from_hf`` has already checked a config's)."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
