"""moeserve: an inference engine and server for Mixture-of-Experts LLMs."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.core import CompletionOutput, RequestOutput, SamplingParams
    from moeserve.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


_CORE = frozenset({"SamplingParams", "RequestOutput", "CompletionOutput"})


def __getattr__(name: str):
    # lazy: importing the package (e.g. the torch-free ``moeserve.planner``) must not pull in
    # torch or build an engine's imports
    if name == "LLM":
        from moeserve.llm import LLM

        return LLM
    if name in _CORE:
        from moeserve import core

        return getattr(core, name)
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
