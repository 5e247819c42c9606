"""Tokenizer, chat templates and streaming detokenization, without transformers at run time.

``Tokenizer.from_dir`` reads a Hugging Face model directory the way transformers'
``AutoTokenizer`` (the ``tokenizers`` backend) does, and only its data files:
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` (plus
``additional_chat_templates/*.jinja``) and ``generation_config.json``. No code from the model
directory is ever run; the chat template runs in jinja2's immutable sandbox.

Chat prompts: ``apply_chat_template`` returns text that already holds the template's special
tokens (DeepSeek's writes the BOS token itself), so encode it with
``encode(text, add_special_tokens=False)``, as vLLM and transformers do; encoding it with
special tokens would add a second BOS.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _Backend

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer directory that is missing, unreadable, or a chat template that fails."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_added_token(value: Any, special: bool = True) -> AddedToken:
    if isinstance(value, dict):
        kw = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        return AddedToken(value["content"], special=value.get("special", special), **kw)
    return AddedToken(value, special=special)


class Tokenizer:
    """A model's tokenizer: encode/decode, chat template, stop ids.

    Built by :meth:`from_dir`. Immutable after construction (the backend is not shared).
    """

    def __init__(
        self,
        backend: _Backend,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
        generation_eos_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens)  # bos_token -> "<s>", ...
        self._chat_templates = dict(chat_templates)  # "default" and other named templates
        self._cleanup = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        eos_ids = set(generation_eos_ids)
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self._eos_ids = frozenset(eos_ids)
        named = {backend.token_to_id(t) for t in self._special_tokens.values()}
        added = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._special_ids = frozenset(i for i in named | added if i is not None)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer files of a Hugging Face model directory.

        Raises TokenizerError when tokenizer.json is missing or unreadable or a JSON file is
        malformed. Matches ``AutoTokenizer.from_pretrained(model_dir)`` for encode, decode and
        chat templates; see the module docstring for what is read.
        """
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"expected tokenizer.json in {d}: not found")
        try:
            backend = _Backend.from_file(str(path))
        except Exception as e:  # the Rust error text is one line
            raise TokenizerError(f"cannot load {path}: {e}") from None
        cfg = _read_json(d / "tokenizer_config.json")
        gen = _read_json(d / "generation_config.json")

        special = {k: c for k in _SPECIAL_TOKEN_KEYS if (c := _token_content(cfg.get(k)))}
        _add_missing_tokens(backend, cfg)
        backend.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        # BOS/EOS: tokenizer.json's post-processor decides when it has one (transformers 5
        # ignores add_bos_token/add_eos_token then). Without one, transformers 5 adds nothing
        # while transformers 4's Llama-style classes honoured the flags; we honour them.
        if backend.post_processor is None:
            backend.post_processor = _bos_eos_processor(
                backend,
                special.get("bos_token") if cfg.get("add_bos_token") else None,
                special.get("eos_token") if cfg.get("add_eos_token") else None,
            )
        eos = gen.get("eos_token_id")
        gen_eos = [eos] if isinstance(eos, int) else [i for i in eos or () if isinstance(i, int)]
        return cls(
            backend,
            special,
            _load_chat_templates(d, cfg),
            gen_eos,
            bool(cfg.get("clean_up_tokenization_spaces", False)),
        )

    # --- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with special tokens, BOS/EOS as the model's config asks."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Bytes of an incomplete UTF-8 character decode to U+FFFD."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._cleanup else text

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (e.g. ``'Ġthe'``), or None if out of range."""
        return self._backend.id_to_token(token_id)

    def convert_ids_to_tokens(
        self, ids: Sequence[int], skip_special_tokens: bool = False
    ) -> list[str | None]:
        return [
            self._backend.id_to_token(i)
            for i in ids
            if not (skip_special_tokens and i in self._special_ids)
        ]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # --- properties --------------------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: generation_config's eos_token_id(s) and the eos token."""
        return self._eos_ids

    @property
    def vocab_size(self) -> int:
        """One more than the largest token id, added tokens included."""
        return max(self._backend.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the named special tokens and of every added token marked special."""
        return self._special_ids

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> str | None:
        return self._chat_templates.get("default")

    # --- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template, as transformers renders it
        with ``tokenize=False``. Encode the result with ``add_special_tokens=False``.

        ``chat_template`` picks a named template or gives a template string; by default the
        ``tool_use`` template is used when tools are given and one exists. Extra ``kwargs``
        reach the template as variables (e.g. ``enable_thinking``). Raises TokenizerError when
        there is no template or the template raises.
        """
        template = self._pick_template(chat_template, tools)
        if not messages:
            raise TokenizerError("cannot apply a chat template to an empty conversation")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise TokenizerError("tools must be JSON-schema dicts")
        chat = [_drop_none(m) for m in messages]
        variables = {**self._special_tokens, **kwargs}
        try:
            return _compile(template).render(
                messages=_plain(_alias_reasoning(chat)),
                tools=_plain(tools),
                documents=_plain(variables.pop("documents", None)),
                add_generation_prompt=add_generation_prompt,
                **_plain(variables),
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None

    def _pick_template(self, chat_template: str | None, tools: list[dict] | None) -> str:
        if chat_template is not None:
            return self._chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" not in self._chat_templates:
            raise TokenizerError(
                "this tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                "or chat_template.jinja); pass chat_template=..."
            )
        return self._chat_templates["default"]


# --- loading helpers --------------------------------------------------------------------------


def _add_missing_tokens(backend: _Backend, cfg: dict[str, Any]) -> None:
    """Add the config's special and added tokens that are not added tokens of tokenizer.json.

    As transformers does: a special token found only in the base vocabulary is re-added (same
    id), which marks it special, so ``decode(skip_special_tokens=True)`` drops it.
    """
    have = {t.content for t in backend.get_added_tokens_decoder().values()}
    decoder = cfg.get("added_tokens_decoder") or {}
    wanted = [v for _, v in sorted(decoder.items(), key=lambda kv: int(kv[0]))]
    wanted += [cfg[k] for k in _SPECIAL_TOKEN_KEYS if _token_content(cfg.get(k))]
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
    wanted += list(extra.values()) if isinstance(extra, dict) else list(extra)
    for value in wanted:
        content = _token_content(value)
        if content and content not in have:
            backend.add_tokens([_as_added_token(value)])
            have.add(content)


def _bos_eos_processor(backend: _Backend, bos: str | None, eos: str | None):
    """``[bos] $A [eos]``, pairs likewise (transformers' ``update_post_processor``)."""
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    tokens = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    for t, i in tokens:
        if i is None:
            raise TokenizerError(f"special token {t!r} is not in the vocabulary")
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _load_chat_templates(d: Path, cfg: dict[str, Any]) -> dict[str, str]:
    """Named templates; chat_template.jinja overrides tokenizer_config.json (transformers 5)."""
    raw = cfg.get("chat_template")
    templates: dict[str, str] = {}
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
        templates = {t["name"]: t["template"] for t in raw}
    jinja_file = d / "chat_template.jinja"
    extra_dir = d / "additional_chat_templates"
    files = {}
    if jinja_file.is_file():
        files["default"] = jinja_file.read_text(encoding="utf-8")
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            files[f.stem] = f.read_text(encoding="utf-8")
    return {**templates, **files} if files else templates


def _clean_up_tokenization(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")):
        text = text.replace(a, b)
    for suffix in ("n't", "'m", "'s", "'ve", "'re"):
        text = text.replace(" " + suffix, suffix)
    return text


# --- chat template rendering ------------------------------------------------------------------


def _drop_none(message: dict) -> dict:
    if not isinstance(message, dict):
        raise TokenizerError(f"chat messages must be dicts, got {type(message).__name__}")
    return {k: v for k, v in message.items() if v is not None}


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """Fill ``reasoning_content`` (and ``thinking``) from any of the names reasoning goes by."""
    out = []
    for m in chat:
        r = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
    return out


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types, so the sandbox sees no foreign methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) lose their extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
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
        raise TokenizerError(f"chat template does not parse: {e} (line {e.lineno})") from None


# --- streaming detokenization -----------------------------------------------------------------

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first outputs (vLLM uses 5 too)


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas as they arrive.

    Each ``step`` decodes a small window ``ids[prefix:]`` and compares it with the text of
    ``ids[prefix:read]`` (vLLM's prefix/read offsets), so byte-level merges and spaces come
    out as a full decode would give them:

        ids:  ... p p p | o o o o | n n
                  ^prefix ^read     new tokens appended at the end

    A delta is emitted only when the window's text does not end in U+FFFD, so a multi-byte
    character split across tokens is never cut. The concatenation of every ``step`` and a
    final ``flush`` equals ``tokenizer.decode(output_ids)`` for byte-level BPE tokenizers;
    a few prompt tokens give the first output its context (a SentencePiece tokenizer then
    keeps the first token's leading space, as vLLM does).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        # a context that ends inside a character would merge with the output's bytes
        if self._decode(context).endswith("\ufffd"):
            context = []
        self._ids = context
        self._prefix = 0
        self._read = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that became final (possibly empty)."""
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._advance(text, prefix_text)

    def flush(self) -> str:
        """Return any held-back text (e.g. a trailing incomplete character as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text):
            return ""
        return self._advance(text, prefix_text)

    def _advance(self, text: str, prefix_text: str) -> str:
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]


def find_stop(text: str, start: int, stops: Iterable[str]) -> tuple[int, str] | None:
    """Earliest stop string in ``text`` that ends after ``start`` (the old text length).

    Returns ``(index, stop)``; the caller cuts ``text[:index]`` (stop excluded). Only the
    tail where a new match can lie is searched: for a stop of length L, ``text[start-L+1:]``.
    Ties go to the stop listed first. Empty stop strings are ignored.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
