"""Tool calling for ``/v1/chat/completions``: what a request's ``tools`` and
``tool_choice`` ask of the prompt, the sampler and the answer.

    tool_choice   prompt        sampling                         answer
    none          tools shown   free                             text
    auto          tools shown   free                             parsed: calls or text
    required      tools shown   held to calls of any tool        parsed calls
    {function}    tools shown   held to calls of that function   parsed calls

``auto`` needs ``--enable-auto-tool-choice`` and every choice but ``none`` needs
``--tool-call-parser`` (vLLM's rule): the parser names the model's call format, the grammar
(``tool_parsers/grammar.py``) writes it with each function's parameters schema, so held
calls always parse and validate. Without ``parallel_tool_calls`` a held answer has one call.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.grammar.markers import marker_tokens
from moeserve.grammar.tokenizer import ll_tokenizer
from moeserve.guided import GuidedDecodingParams
from moeserve.serving.errors import bad_request
from moeserve.serving.protocol import ChatCompletionRequest
from moeserve.serving.tool_parsers import ToolFormat, tool_format
from moeserve.serving.tool_parsers.grammar import MARKERS, tool_call_grammar, tool_functions
from moeserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolPlan:
    """``tools`` for the chat template (None: none given), the format to read calls in
    (None: answer with text) and the grammar that holds sampling to calls (None: free)."""

    tools: list[dict] | None = None
    fmt: ToolFormat | None = None
    guided: GuidedDecodingParams | None = None


def plan_tools(
    req: ChatCompletionRequest,
    parser: str | None,
    auto_tool_choice: bool,
    tokenizer: Tokenizer | None = None,
) -> ToolPlan:
    """The request's plan; 400 naming the field for tools that are malformed, a choice
    this server was not started for, or a named function that is not among the tools.
    ``tokenizer``: the model's, whose one-token markers the grammar names as tokens (the
    first call builds llguidance's view of it: call off the event loop)."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    named = _named(choice)
    try:
        functions = tool_functions(req.tools, only=named)
    except ValueError as e:
        raise bad_request(str(e), "tool_choice" if "tool_choice" in str(e) else "tools") from None
    if choice == "none":
        return ToolPlan(tools=req.tools)
    if parser is None:
        raise bad_request(
            f'tool_choice "{choice if named is None else "function"}" needs the server '
            "started with --tool-call-parser",
            "tool_choice",
        )
    if choice == "auto":
        if not auto_tool_choice:
            raise bad_request(
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
                "tool_choice",
            )
        return ToolPlan(tools=req.tools, fmt=tool_format(parser))
    tokens = {}
    if tokenizer is not None:
        ll_tok = ll_tokenizer(tokenizer, tokenizer.vocab_size)
        tokens = marker_tokens(tokenizer, ll_tok, MARKERS[parser])
    lark = tool_call_grammar(parser, functions, req.parallel_tool_calls, tokens)
    return ToolPlan(req.tools, tool_format(parser), GuidedDecodingParams(grammar=lark))


def _named(choice) -> str | None:
    """The function a named ``tool_choice`` asks for (None for the string choices)."""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                f"tool_choice must be none, auto, required or a function, got {choice!r}",
                "tool_choice",
            )
        return None
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return name
