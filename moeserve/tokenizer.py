"""Tokenizer and chat templates from a model directory, without transformers at run time.

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
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _Backend

from moeserve.chat_template import ChatTemplateError, render_chat_template

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


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
        self._added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}

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
        """Token ids of ``text``; with special tokens, BOS/EOS as the model's config asks.

        Through the batch call, which releases the GIL while it works (the single-text
        ``encode`` of ``tokenizers`` holds it): a thread that tokenizes a long prompt leaves
        the rest of the process running."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Bytes of an incomplete UTF-8 character decode to U+FFFD."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._cleanup else text

    def decode_long(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """:meth:`decode` through the batch call, which releases the GIL (for whole prompts
        decoded on a worker thread; the per-token calls of streaming stay on ``decode``)."""
        texts = self._backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(texts[0]) if self._cleanup else texts[0]

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

    def backend_json(self) -> str:
        """The backend as ``tokenizer.json`` text, added tokens included (what
        llguidance reads: ``moeserve/grammar/tokenizer.py``)."""
        return self._backend.to_str()

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token whose text is ``text`` (DeepSeek's ``<｜tool▁sep｜>``,
        R1's ``</think>``), or None when ``text`` is not one."""
        return self._added.get(text)

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
        template = self.pick_chat_template(chat_template, tools)
        if not messages:
            raise TokenizerError("cannot apply a chat template to an empty conversation")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise TokenizerError("tools must be JSON-schema dicts")
        try:
            return render_chat_template(
                template, messages, add_generation_prompt, tools, self.chat_variables(kwargs)
            )
        except ChatTemplateError as e:
            raise TokenizerError(str(e)) from None

    def chat_variables(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The variables a chat template sees besides messages and tools: the special tokens
        (``bos_token``, ...), then ``kwargs``."""
        return {**self._special_tokens, **kwargs}

    def is_own_chat_template(self, chat_template: str) -> bool:
        """Whether ``chat_template`` names (or is the text of) one of the model's templates,
        as opposed to template code from elsewhere."""
        return chat_template in self._chat_templates or chat_template in set(
            self._chat_templates.values()
        )

    def pick_chat_template(self, chat_template: str | None, tools: list[dict] | None) -> str:
        """The template text: ``chat_template`` (a name of the model's templates, or template
        text), else ``tool_use`` when tools are given and the model has one, else the default.
        Raises TokenizerError when the model has none."""
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
