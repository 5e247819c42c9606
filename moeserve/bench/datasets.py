"""Request sources for the serving benchmark: random token prompts, or a JSONL file.

``random`` (vLLM's random dataset): input lengths are drawn uniformly from the integers in
``[floor(L * (1 - r)), ceil(L * (1 + r))]`` with ``L = --random-input-len`` and
``r = --random-range-ratio`` (``0 <= r < 1``, vLLM's current definition), output lengths likewise
from ``--random-output-len``. Each prompt is random non-special token ids decoded to text, then
re-encoded and trimmed or extended until the text tokenizes to the drawn length (within one
token; the recorded ``prompt_len`` is the exact count). Everything is seeded: the same seed and
tokenizer give the same requests.

``FILE.jsonl``: one JSON object per line with ``"prompt"`` (a string) or ``"messages"`` (a chat
list), and an optional positive ``"output_len"``. Blank lines are skipped.

Tokens are counted by a :class:`TokenCodec`: a local tokenizer directory (:class:`LocalCodec`) or
the server's ``/tokenize`` and ``/detokenize`` endpoints (:class:`ServerCodec`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

FIT_ROUNDS = 10  # re-encode/trim/extend rounds before accepting a prompt's length as it is


class DatasetError(ValueError):
    """A dataset that cannot be read or built: bad JSONL line, bad lengths, no tokenizer."""


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: a completion prompt or chat messages, and the tokens to generate.

    ``prompt_len`` counts the prompt's tokens (for ``messages``, the sum over the text contents,
    without the chat template's tokens, as vLLM counts them).
    """

    prompt: str
    prompt_len: int
    output_len: int
    messages: tuple[dict[str, Any], ...] | None = None


class TokenCodec(Protocol):
    """Text <-> token ids without special tokens, and the vocabulary to draw ids from."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class LocalCodec:
    """A :class:`TokenCodec` over ``moeserve.tokenizer.Tokenizer`` (``--tokenizer DIR``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @classmethod
    def from_dir(cls, path: str | Path) -> LocalCodec:
        from moeserve.tokenizer import Tokenizer

        return cls(Tokenizer.from_dir(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self._tok.all_special_ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class ServerCodec:
    """A :class:`TokenCodec` over a server's ``POST /tokenize`` and ``POST /detokenize``.

    The server does not list its special ids. The ones it adds itself (BOS/EOS: what
    tokenizing "a" with special tokens adds) are avoided; others (chat-role markers) may appear
    in random prompts: pass ``--tokenizer`` to avoid them all. Raises RuntimeError on a failed call.
    """

    def __init__(
        self,
        base_url: str,
        vocab_size: int,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> None:
        import httpx

        self._base = base_url.rstrip("/")
        self._vocab_size = vocab_size
        self._special_ids: frozenset[int] | None = None
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        self._client = httpx.Client(headers=headers, timeout=timeout, limits=limits)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        if self._special_ids is None:  # what add_special_tokens adds to a one-letter prompt
            body = {"prompt": "a", "add_special_tokens": True}
            added = set(self._post("/tokenize", body)["tokens"]) - set(self.encode("a"))
            self._special_ids = frozenset(added)
        return self._special_ids

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self._base}{path}"
        r = self._client.post(url, json=body)
        if r.status_code != 200:
            raise RuntimeError(
                f"POST {url} returned HTTP {r.status_code}: {r.text[:300]}; the server needs "
                "vLLM's /tokenize and /detokenize endpoints, or pass --tokenizer DIR"
            )
        return r.json()

    def encode(self, text: str) -> list[int]:
        return list(
            self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        )

    def decode(self, ids: Sequence[int]) -> str:
        return self._post("/detokenize", {"tokens": list(ids)})["prompt"]

    def close(self) -> None:
        self._client.close()


def length_bounds(mean: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive range lengths are drawn from: ``[floor(L(1-r)), ceil(L(1+r))]``, >= 1."""
    if mean < 1:
        raise DatasetError(f"random lengths must be >= 1, got {mean}")
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1.0 - range_ratio)))
    return low, max(low, math.ceil(mean * (1.0 + range_ratio)))


def _fit_prompt(
    codec: TokenCodec, target: int, allowed: np.ndarray, rng: np.random.Generator
) -> tuple[str, int]:
    """Text from random ids that re-encodes to ``target`` tokens, and its exact length.

    Decoding random ids and re-encoding the text rarely gives the same ids back, so the ids are
    trimmed or extended and re-decoded until the count is exact; after FIT_ROUNDS the closest
    non-empty text is kept (in practice within one token). A trailing U+FFFD (a UTF-8
    sequence cut by the trim) is dropped.
    """
    text = codec.decode(rng.choice(allowed, size=target).tolist()).rstrip("\ufffd")
    best: tuple[str, int] | None = None
    for _ in range(FIT_ROUNDS):
        ids = codec.encode(text)
        n = len(ids)
        if n > 0 and (best is None or abs(n - target) < abs(best[1] - target)):
            best = (text, n)
        if n == target:
            break
        ids = ids[:target] if n > target else ids + rng.choice(allowed, size=target - n).tolist()
        text = codec.decode(ids).rstrip("\ufffd")
    if best is None:
        raise DatasetError(f"could not build a non-empty prompt of {target} tokens")
    return best


def random_requests(
    codec: TokenCodec,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    workers: int = 8,
) -> list[BenchRequest]:
    """``num_prompts`` random prompts (see the module docstring); deterministic in ``seed``.

    Raises DatasetError for bad lengths or a vocabulary with no non-special id.
    """
    if num_prompts < 1:
        raise DatasetError(f"--num-prompts must be >= 1, got {num_prompts}")
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts).tolist()
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts).tolist()
    allowed = np.setdiff1d(np.arange(codec.vocab_size), np.fromiter(codec.special_ids, int))
    if allowed.size == 0:
        raise DatasetError(f"the vocabulary ({codec.vocab_size} ids) has no non-special token")

    def build(i: int) -> BenchRequest:
        # one generator per prompt, so the result does not depend on thread scheduling
        text, n = _fit_prompt(codec, in_lens[i], allowed, np.random.default_rng([seed, i]))
        return BenchRequest(prompt=text, prompt_len=n, output_len=out_lens[i])

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(build, range(num_prompts)))


def _parse_line(obj: Any, where: str, default_output_len: int) -> tuple[str, list | None, int]:
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise DatasetError(f'{where}: expected exactly one of "prompt" or "messages"')
    output_len = obj.get("output_len", default_output_len)
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise DatasetError(f'{where}: "output_len" must be a positive integer, got {output_len!r}')
    if has_prompt:
        if not isinstance(obj["prompt"], str):
            raise DatasetError(f'{where}: "prompt" must be a string')
        return obj["prompt"], None, output_len
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f'{where}: "messages" must be a non-empty list')
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DatasetError(f'{where}: messages[{j}] must be an object with "role", "content"')
    return "", messages, output_len


def _message_text(messages: Sequence[dict[str, Any]]) -> str:
    """The text contents of chat messages, joined (string contents and "text" parts)."""
    parts: list[str] = []
    for m in messages:
        c = m["content"]
        if isinstance(c, str):
            parts.append(c)
        elif isinstance(c, list):
            parts += [
                p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str)
            ]
    return "\n".join(parts)


def load_jsonl(
    path: str | Path, codec: TokenCodec, num_prompts: int, default_output_len: int
) -> list[BenchRequest]:
    """The first ``num_prompts`` requests of a JSONL file, repeating the file if it is shorter.

    Raises DatasetError naming the file and line for a bad line, or for a missing/empty file.
    """
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file {p}: not found (use 'random' or a .jsonl path)")
    if num_prompts < 1:
        raise DatasetError(f"--num-prompts must be >= 1, got {num_prompts}")
    parsed: list[tuple[str, list | None, int]] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg})") from None
            parsed.append(_parse_line(obj, where, default_output_len))
            if len(parsed) == num_prompts:
                break
    if not parsed:
        raise DatasetError(f"dataset file {p} holds no requests")
    out: list[BenchRequest] = []
    for prompt, messages, output_len in parsed:
        text = prompt if messages is None else _message_text(messages)
        msgs = None if messages is None else tuple(messages)
        out.append(BenchRequest(prompt, len(codec.encode(text)), output_len, msgs))
    return [out[i % len(out)] for i in range(num_prompts)]


def build_requests(
    dataset: str,
    codec: TokenCodec,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """``dataset`` is ``"random"`` or a JSONL path; see the module docstring."""
    if dataset == "random":
        return random_requests(codec, num_prompts, input_len, output_len, range_ratio, seed)
    return load_jsonl(dataset, codec, num_prompts, output_len)
