"""moeserve: an inference engine and server for Mixture-of-Experts LLMs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moeserve.core import CompletionOutput, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from moeserve.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing the package must not build an engine's imports
        from moeserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
