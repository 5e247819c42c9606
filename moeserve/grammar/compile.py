"""A request's ``GuidedDecodingParams`` as an llguidance grammar, checked.

    json          the schema, JSON Schema as llguidance supports it (``x-guidance``
                  options: compact whitespace unless ``whitespace_flexible``; a keyword
                  it cannot enforce is an error when ``strict``, else ignored)
    json_object   the schema ``{"type": "object"}``
    regex         the regex (Rust ``regex`` syntax, close to Python's for common patterns)
    choice        a Lark grammar of one string literal per choice
    grammar       Lark; GBNF (``root ::= ...``, llama.cpp's and xgrammar's form) converted
    free_text     any text (a thinking budget alone: the section is held, not the answer)

:func:`check` compiles the grammar against a tokenizer and raises :class:`GrammarError`
naming what is wrong, so the API refuses a request before it reaches the engine.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

import llguidance as llg
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from moeserve.grammar.markers import marker_tokens
from moeserve.grammar.tokenizer import ll_tokenizer
from moeserve.guided import THINK_END, THINK_START, GuidedDecodingParams
from moeserve.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled; ``kind`` says which."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# The thinking section before the held answer. Where the tokenizer has "</think>" as one
# token (R1's, Qwen3's, the demo's), the section is any text without "</think>" in it, then
# that token. Where "</think>" is text, the section is a lexeme that ends with it
# (llguidance's suffix). A budget is counted beside the grammar (``grammar/budget.py``), on
# token ids: it needs the markers as tokens. The whitespace around the section is bounded
# (R1 writes "\n\n" after "</think>"): unbounded, a model that never learned the answer's
# format spends its tokens on spaces (vLLM's --disable-any-whitespace is for the same failure).
_WS = "ws: /[ \\t\\n]{0,4}/\n"
_END_RE = re.escape(THINK_END).replace("/", "\\/")  # inside a Lark /regex/
_THINK_TEXT = f"THINK: /(?s:.*)/ & ~/(?s:.*){_END_RE}(?s:.*)/\n"


def _after_thinking(mode: str, budget: int | None, start: int | None, end: int | None) -> str:
    """The Lark grammar of a thinking section (``mode`` inside or optional) followed by
    ``@answer``; ``start``/``end``: the ids of "<think>"/"</think>" as one token, or None."""
    spelled = [m for m, t in ((THINK_END, end), (THINK_START, start)) if t is None]
    if budget is not None and spelled and (spelled[0] == THINK_END or mode == "optional"):
        raise GrammarError(
            "thinking_budget",
            f"a thinking budget needs {spelled[0]} as one token of the tokenizer, and this "
            "tokenizer spells it",
        )
    opening = f"<[{start}]>" if start is not None else json.dumps(THINK_START)
    if end is None:
        section, rules = "think", f'think[suffix="{THINK_END}"]: /(?s:.*)/\n'
    else:
        section, rules = f"THINK <[{end}]>", _THINK_TEXT
    if mode == "inside":
        top = f"start: {section} ws @answer\n"
    else:
        top = f"start: (ws {opening} {section} ws)? @answer\n"
    return top + rules + _WS


def think_tokens(tokenizer: Tokenizer, ll_tok: llg.LLTokenizer) -> tuple[int | None, int | None]:
    """The ids of "<think>" and "</think>" where ``tokenizer`` has each as one token."""
    ids = marker_tokens(tokenizer, ll_tok, (THINK_START, THINK_END))
    return ids.get(THINK_START), ids.get(THINK_END)


@lru_cache(maxsize=256)
def grammar_of(
    params: GuidedDecodingParams, think_start: int | None = None, think_end: int | None = None
) -> str:
    """The llguidance grammar (its JSON text) for ``params``, after a free thinking section
    when ``params.thinking`` says so; ``think_start``/``think_end``: the ids of "<think>" and
    "</think>" where the tokenizer has each as one token. Raises GrammarError."""
    answer = _answer_grammar(params)
    if not params.thinking:
        return answer
    top = json.loads(answer)
    held = dict(top["grammars"][0], name="answer")
    lark = _after_thinking(params.thinking, params.thinking_budget, think_start, think_end)
    main = {"name": "after_thinking", "lark_grammar": lark}
    return json.dumps({**top, "grammars": [main, held, *top["grammars"][1:]]})


def _answer_grammar(params: GuidedDecodingParams) -> str:
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.schema
            if not isinstance(schema, dict | bool):
                raise GrammarError(kind, "a JSON schema must be an object or a boolean")
            options = {
                "whitespace_flexible": params.whitespace_flexible,
                "lenient": not params.strict,
            }
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(params.regex)
        if kind == "free_text":
            return _lark("start: /(?s:.*)/\n")
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in params.choice)
            return _lark(f"start: {alternatives}\n")
        return _lark(any_to_lark(params.grammar))
    except GrammarError:
        raise
    except (ValueError, TypeError, RuntimeError, GbnfToLarkError) as e:  # malformed input
        raise GrammarError(kind, f"invalid {kind}: {e}") from e


def _lark(text: str) -> str:
    """A Lark grammar in llguidance's JSON form, as the other kinds come (llguidance's
    ``grammar_from_lark`` returns the bare text, which cannot be composed)."""
    return json.dumps({"grammars": [{"name": "lark", "lark_grammar": text}], "max_tokens": None})


def compile_for(
    params: GuidedDecodingParams, tokenizer: Tokenizer | None, vocab: int
) -> tuple[llg.LLTokenizer, str]:
    """``params`` compiled for a model's ``tokenizer`` over ``vocab`` ids: llguidance's
    tokenizer and the checked grammar. Raises ValueError without a tokenizer, GrammarError
    (a ValueError) when the grammar does not compile."""
    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer, and this model has none")
    tok = ll_tokenizer(tokenizer, vocab)
    start, end = think_tokens(tokenizer, tok) if params.thinking else (None, None)
    return tok, check(params, tok, start, end)


def check(
    params: GuidedDecodingParams,
    tokenizer: llg.LLTokenizer,
    think_start: int | None = None,
    think_end: int | None = None,
) -> str:
    """Compile ``params`` for ``tokenizer`` (``think_start``/``think_end``: as for
    :func:`grammar_of`); returns the grammar. Raises GrammarError with llguidance's first
    message when it does not compile."""
    grammar = grammar_of(params, think_start, think_end)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        first = messages[0] if messages else "does not compile"
        raise GrammarError(params.kind, f"invalid {params.kind}: {first.strip()}")
    return grammar
