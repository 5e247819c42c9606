"""Tool calls in a model's text, in OpenAI's shape (``--tool-call-parser``, vLLM's names).

    base.py          the scan every format gives (content, calls so far) and the stream
                     that turns successive scans into OpenAI deltas
    deepseek.py      DeepSeek-V3/R1 (``deepseek_v3``) and V3.1 (``deepseek_v31``) tokens
    hermes.py        ``<tool_call>{json}</tool_call>`` (``hermes``: Qwen2.5 and Qwen3)

A parser never raises on model output: text it cannot read as tool calls is content.
"""

from __future__ import annotations

from moeserve.serving.tool_parsers.base import ParsedMessage, ToolCall, ToolCallStream, ToolFormat
from moeserve.serving.tool_parsers.deepseek import DeepSeekV3, DeepSeekV31
from moeserve.serving.tool_parsers.hermes import Hermes

PARSERS: dict[str, type[ToolFormat]] = {
    "deepseek_v3": DeepSeekV3,
    "deepseek_v31": DeepSeekV31,
    "hermes": Hermes,
}


def tool_format(name: str) -> ToolFormat:
    """The format named ``name``; ValueError naming the known ones."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose {', '.join(PARSERS)}")
    return PARSERS[name]()


__all__ = ["PARSERS", "ParsedMessage", "ToolCall", "ToolCallStream", "ToolFormat", "tool_format"]
