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


def resolve_architecture(architectures: list[str], source: str = "config.json") -> str:
    """The first supported entry of ``architectures``; a clear error listing what we support."""
    from moeserve.models.hf_config import ConfigError

    for arch in architectures:
        if arch in _MODELS:
            return arch
    raise ConfigError(
        f"{source}: unsupported architecture {architectures or '(none given)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def model_class(architecture: str) -> type[nn.Module]:
    module, name = _MODELS[resolve_architecture([architecture])]
    return getattr(importlib.import_module(module), name)
