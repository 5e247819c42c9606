"""A request's ``GuidedDecodingParams`` as an llguidance grammar, checked.

    json          the schema, JSON Schema as llguidance supports it (``x-guidance``
                  options: compact whitespace unless ``whitespace_flexible``; a keyword
                  it cannot enforce is an error when ``strict``, else ignored)
    json_object   the schema ``{"type": "object"}``
    regex         the regex (Rust ``regex`` syntax, close to Python's for common patterns)
    choice        a Lark grammar of one string literal per choice
    grammar       Lark; GBNF (``root ::= ...``, llama.cpp's and xgrammar's form) converted

:func:`check` compiles the grammar against a tokenizer and raises :class:`GrammarError`
naming what is wrong, so the API refuses a request before it reaches the engine.
"""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance as llg
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from moeserve.grammar.tokenizer import ll_tokenizer
from moeserve.guided import GuidedDecodingParams
from moeserve.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled; ``kind`` says which."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# the free thinking section before the held answer: anything, up to and with "</think>"
_THINK = 'think[suffix="</think>"]: /(?s:.*)/\nws: /[ \\t\\n]*/\n'
_AFTER = {
    "inside": "start: think ws @answer\n" + _THINK,
    "optional": 'start: (ws "<think>" think ws)? @answer\n' + _THINK,
}


@lru_cache(maxsize=256)
def grammar_of(params: GuidedDecodingParams) -> str:
    """The llguidance grammar (its JSON text) for ``params``, after a free thinking section
    when ``params.thinking`` says so. Raises GrammarError."""
    answer = _answer_grammar(params)
    if not params.thinking:
        return answer
    top = json.loads(answer)
    held = dict(top["grammars"][0], name="answer")
    main = {"name": "after_thinking", "lark_grammar": _AFTER[params.thinking]}
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
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in params.choice)
            return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        return llg.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
    except GrammarError:
        raise
    except (ValueError, TypeError, RuntimeError, GbnfToLarkError) as e:  # malformed input
        raise GrammarError(kind, f"invalid {kind}: {e}") from e


def compile_for(
    params: GuidedDecodingParams, tokenizer: Tokenizer | None, vocab: int
) -> tuple[llg.LLTokenizer, str]:
    """``params`` compiled for a model's ``tokenizer`` over ``vocab`` ids: llguidance's
    tokenizer and the checked grammar. Raises ValueError without a tokenizer, GrammarError
    (a ValueError) when the grammar does not compile."""
    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer, and this model has none")
    tok = ll_tokenizer(tokenizer, vocab)
    return tok, check(params, tok)


def check(params: GuidedDecodingParams, tokenizer: llg.LLTokenizer) -> str:
    """Compile ``params`` for ``tokenizer``; returns the grammar. Raises GrammarError with
    llguidance's first message when it does not compile."""
    grammar = grammar_of(params)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        first = messages[0] if messages else "does not compile"
        raise GrammarError(params.kind, f"invalid {params.kind}: {first.strip()}")
    return grammar
