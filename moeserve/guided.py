"""What a request's output is held to (structured output): vLLM's ``GuidedDecodingParams``.

Exactly one of ``json`` (a JSON schema, as its JSON text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of these strings), ``grammar`` (a Lark grammar, or
GBNF as llama.cpp and xgrammar write it) or ``free_text`` (any text: what a thinking budget
alone holds the answer to) is set. The engine compiles it for the request's
sampler (``moeserve/grammar/``); the API fills it from ``response_format`` and the
``guided_*`` fields. Ground floor: plain data, imports nothing of moeserve.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "free_text")
THINK_START, THINK_END = "<think>", "</think>"  # a reasoning model's thinking section


@dataclass(frozen=True)
class GuidedDecodingParams:
    json: str | None = None  # a JSON schema's text (a dict given here is serialized)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    free_text: bool = False
    # JSON: allow whitespace where JSON does (default: the compact form a model emits)
    whitespace_flexible: bool = False
    # JSON: refuse schema keywords the grammar cannot enforce (False: ignore them)
    strict: bool = True
    # a reasoning model's thinking section comes first, free, and the grammar holds what
    # follows it: "inside" (the output starts in it, up to "</think>"), "optional" (the
    # model may open one with "<think>"), "" (none)
    thinking: str = ""
    # at most this many tokens of thinking, then "</think>" is forced (vLLM's
    # thinking_token_budget); None: no limit. Only with ``thinking``.
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", _json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("guided choice must be a non-empty list of strings")
        if self.thinking not in ("", "inside", "optional"):
            raise ValueError(f"thinking must be '', inside or optional, got {self.thinking!r}")
        budget = self.thinking_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise ValueError(f"thinking_budget must be an integer, got {budget!r}")
        if budget is not None and budget < 0:
            raise ValueError(f"thinking_budget must be >= 0, got {budget}")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured output takes exactly one of json, json_object, regex, choice, "
                f"grammar or free_text; got {given or 'none'}"
            )

    @property
    def kind(self) -> str:
        """Which of :data:`KINDS` is set."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> Any:
        """The JSON schema as an object (``json_object``: any object), else None."""
        if self.json is not None:
            return _json.loads(self.json)
        return {"type": "object"} if self.json_object else None
