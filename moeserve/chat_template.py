"""Chat-template rendering the way transformers renders it (``tokenize=False``).

The template runs in jinja2's immutable sandbox with transformers' globals (``raise_exception``,
``strftime_now``), its ``tojson`` filter, ``loopcontrols`` and the ``{% generation %}`` tag;
inputs are rebuilt from plain JSON types (nested at most ``MAX_INPUT_DEPTH`` deep) so the
sandbox sees no foreign methods. Whatever a template raises on its input (``1/0``, a bad
``range``, an overflow, unbounded recursion) ends as one :class:`ChatTemplateError` line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MAX_INPUT_DEPTH = 64  # nesting of messages, tools and variables (JSON schemas stay far below)
_MAX_MESSAGE_CHARS = 300  # of an exception's text in ChatTemplateError


class ChatTemplateError(ValueError):
    """The conversation or the template is unusable; one-line message."""


def render_chat_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    variables: dict[str, Any],
    max_output_chars: int | None = None,
) -> str:
    """Render ``messages`` with ``template``; ``variables`` (special tokens, template kwargs
    such as ``enable_thinking``) become template variables. Raises ChatTemplateError, also
    when the output grows past ``max_output_chars``."""
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ChatTemplateError("tools must be JSON-schema dicts")
    chat = [_drop_none(m) for m in messages]
    variables = dict(variables)
    compiled = _compile(template)
    inputs = dict(
        messages=_plain(_alias_reasoning(chat)),
        tools=_plain(tools),
        documents=_plain(variables.pop("documents", None)),
        add_generation_prompt=add_generation_prompt,
    )
    plain_vars = _plain(variables)
    if clash := sorted(set(plain_vars) & set(inputs)):
        raise ChatTemplateError(f"template variables cannot override {', '.join(clash)}")
    try:
        return _render(compiled, {**inputs, **plain_vars}, max_output_chars)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {_short(e)}") from None
    except Exception as e:  # the template's own failure on its input: 1/0, range(0, 1, 0), ...
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_short(e)}") from None


def _render(compiled: jinja2.Template, inputs: dict, max_output_chars: int | None) -> str:
    if max_output_chars is None:
        return compiled.render(**inputs)
    parts, size = [], 0
    for part in compiled.generate(**inputs):
        size += len(part)
        if size > max_output_chars:
            raise ChatTemplateError(
                f"the chat template's output exceeds {max_output_chars} characters"
            )
        parts.append(part)
    return "".join(parts)


def _short(e: BaseException) -> str:
    text = str(e)
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."


def _drop_none(message: dict) -> dict:
    if not isinstance(message, dict):
        raise ChatTemplateError(f"chat messages must be dicts, got {type(message).__name__}")
    return {k: v for k, v in message.items() if v is not None}


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """Fill ``reasoning_content`` (and ``thinking``) from any of the names reasoning goes by."""
    out = []
    for m in chat:
        r = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
    return out


def _plain(value: Any, depth: int = 0) -> Any:
    """Rebuild template inputs from plain JSON types, so the sandbox sees no foreign methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if depth >= MAX_INPUT_DEPTH:
        raise ChatTemplateError(f"chat template inputs nest deeper than {MAX_INPUT_DEPTH} levels")
    if isinstance(value, str):  # subclasses (enums, ...) lose their extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v, depth + 1) for v in value)
    if isinstance(value, list):
        return [_plain(v, depth + 1) for v in value]
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` in templates, without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (no path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; transformers' (and ours) does not
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e} (line {e.lineno})") from None
    except Exception as e:  # e.g. RecursionError from a template nested too deep to compile
        raise ChatTemplateError(f"chat template does not parse: {type(e).__name__}") from None
