"""The grammar that makes a model call tools in its parser's format (``tool_choice``
``required`` or a named function): every call's arguments are held to that function's
``parameters`` schema, so they always validate. Lark, with llguidance's ``%json`` for the
arguments::

    hermes        start: call ("\\n" call)*
                  call:  "<tool_call>\\n{\\"name\\": \\"f\\", \\"arguments\\": "
                         args_f "}\\n</tool_call>"
    deepseek_v3   start: "<｜tool▁calls▁begin｜>" call ("\\n" call)* "<｜tool▁calls▁end｜>"
                  call:  "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n" args_f
                         "\\n```<｜tool▁call▁end｜>"
    deepseek_v31  as deepseek_v3, with
                  call:  "<｜tool▁call▁begin｜>f<｜tool▁sep｜>" args_f "<｜tool▁call▁end｜>"

    args_f: %json {f's parameters}

One call only without ``parallel_tool_calls``. A marker the tokenizer has as one token
(DeepSeek's ``<｜tool▁sep｜>`` and the rest, Qwen3's ``<tool_call>``) is that token
(``<[id]>``, ``moeserve/grammar/markers.py``), else text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from moeserve.grammar.markers import lark_text
from moeserve.serving.tool_parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from moeserve.serving.tool_parsers.hermes import CLOSE, OPEN


def tool_functions(tools: list[dict], only: str | None = None) -> list[tuple[str, dict]]:
    """``(name, parameters schema)`` of each function tool (``only``: that one). Raises
    ValueError for a tool without a function name, or ``only`` not among them."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] is not a function tool")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name is missing")
        # no parameters: OpenAI's "empty parameter list", so the arguments are {}
        params = fn.get("parameters") or {"type": "object", "additionalProperties": False}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append((name, params))
    if only is not None:
        out = [f for f in out if f[0] == only]
        if not out:
            raise ValueError(f"tool_choice names {only!r}, which is not among the tools")
    return out


MARKERS = {
    "hermes": (OPEN, CLOSE),
    "deepseek_v3": (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP),
    "deepseek_v31": (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP),
}  # what each format's grammar writes as a token where the tokenizer has one


def tool_call_grammar(
    parser: str,
    functions: list[tuple[str, dict]],
    parallel: bool = True,
    tokens: Mapping[str, int] | None = None,
) -> str:
    """The Lark grammar of calls to ``functions`` in ``parser``'s format (see the module's
    doc); ``tokens``: the markers the tokenizer has as one token, with their ids. Raises
    ValueError for an unknown parser or no function."""
    if not functions:
        raise ValueError("no function to call")
    if parser not in MARKERS:
        raise ValueError(f"no tool-call grammar for parser {parser!r}")
    tokens = tokens or {}

    def _lit(text: str) -> str:
        return lark_text(text, tokens)

    rules, calls = [], []
    for i, (name, params) in enumerate(functions):
        args = f"args_{i}"
        rules.append(f"{args}: %json {json.dumps(params)}")
        if parser == "hermes":
            head = f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": '
            body = f"{_lit(head)} {args} {_lit('}' + chr(10) + CLOSE)}"
        elif parser == "deepseek_v3":
            head = f"{CALL_BEGIN}function{SEP}{name}\n```json\n"
            body = f"{_lit(head)} {args} {_lit(chr(10) + '```' + CALL_END)}"
        else:  # deepseek_v31
            body = f"{_lit(CALL_BEGIN + name + SEP)} {args} {_lit(CALL_END)}"
        calls.append(f"call_{i}: {body}")
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))
    if parser == "hermes":
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    else:
        many = 'call ("\\n" call)*' if parallel else "call"
        start = f"start: {_lit(CALLS_BEGIN)} {many} {_lit(CALLS_END)}"
    return "\n".join([start, call, *calls, *rules]) + "\n"
