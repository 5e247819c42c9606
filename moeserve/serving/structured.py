"""A request's structured output, from OpenAI's ``response_format`` or vLLM's ``guided_*``
fields, checked here so that a bad schema, regex or grammar is a 400 naming its field
before the request reaches the engine (which compiles it again, from a cache).

    response_format  {"type": "json_object"}                  any JSON object
                     {"type": "json_schema", "json_schema":   OpenAI's shape; ``strict``
                        {"name", "schema", "strict"}}         refuses what cannot be enforced
    guided_json      a schema (object or its JSON text)       vLLM's extra fields
    guided_regex     a regex
    guided_choice    one of these strings
    guided_grammar   Lark, or GBNF
"""

from __future__ import annotations

import dataclasses
import json

from moeserve.grammar.compile import compile_for
from moeserve.guided import GuidedDecodingParams
from moeserve.serving.errors import bad_request
from moeserve.serving.protocol import ChatCompletionRequest, CompletionRequest
from moeserve.tokenizer import Tokenizer

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided_params(
    req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer | None
) -> GuidedDecodingParams | None:
    """The request's structured output (None: free text); 400 naming the field when it
    is malformed, does not compile, or two fields ask for it."""
    given = [f for f in _GUIDED if getattr(req, f) is not None]
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        given.insert(0, "response_format")
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(
            f"{given[0]} and {given[1]} both ask for structured output: send one", given[1]
        )
    field = given[0]
    params = _params(req, field)
    check_compiles(params, tokenizer, field)
    return params


def after_thinking(
    guided: GuidedDecodingParams | None, mode: str, budget: int | None
) -> GuidedDecodingParams | None:
    """``guided`` held after a reasoning model's thinking section (``mode``: inside or
    optional, see ``reasoning.thinking_mode``; "" when the prompt has none) of at most
    ``budget`` tokens (``thinking_token_budget``): a budget alone holds only the section,
    the answer is free. No section: ``guided`` as it is (a budget caps nothing)."""
    if not mode:
        return guided
    if guided is None:
        if budget is None:
            return None
        guided = GuidedDecodingParams(free_text=True)
    return dataclasses.replace(guided, thinking=mode, thinking_budget=budget)


def check_compiles(params: GuidedDecodingParams, tokenizer: Tokenizer | None, field: str) -> None:
    """400 naming ``field`` when ``params`` do not compile (or there is no tokenizer)."""
    try:
        compile_for(params, tokenizer, tokenizer.vocab_size if tokenizer else 0)
    except ValueError as e:  # no tokenizer, or a GrammarError
        raise bad_request(str(e), field) from None


def _params(req: CompletionRequest | ChatCompletionRequest, field: str) -> GuidedDecodingParams:
    try:
        if field == "response_format":
            fmt = req.response_format
            if fmt.type == "json_object":
                return GuidedDecodingParams(json_object=True)
            spec = fmt.json_schema
            if spec is None or spec.json_schema is None:
                raise bad_request(
                    "response_format json_schema needs json_schema.schema",
                    "response_format.json_schema",
                )
            return GuidedDecodingParams(json=spec.json_schema, strict=bool(spec.strict))
        if field == "guided_json":
            schema = req.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise bad_request(f"guided_json is not JSON: {e}", field) from None
            return GuidedDecodingParams(json=schema)
        if field == "guided_regex":
            return GuidedDecodingParams(regex=req.guided_regex)
        if field == "guided_choice":
            return GuidedDecodingParams(choice=tuple(req.guided_choice))
        return GuidedDecodingParams(grammar=req.guided_grammar)
    except ValueError as e:
        raise bad_request(str(e), field) from None
