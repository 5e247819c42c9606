"""One streamed OpenAI request, timed: the benchmark's only contact with the server's API.

The response is Server-Sent Events: ``data: {json}`` lines ending with ``data: [DONE]``. A chunk
carries text in ``choices[0].text`` (completions) or ``choices[0].delta.content`` /
``reasoning_content`` (chat). TTFT is the arrival of the first chunk with non-empty text, ITL the
gaps between later text chunks. The output token count is ``usage.completion_tokens`` of the
final usage chunk (``stream_options.include_usage``), else the number of text chunks.

A non-200 status, a chunk ``{"error": ...}``, a transport error, a timeout or a stream without
any text marks the request failed, with the message kept in ``RequestRecord.error``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from moeserve.bench.metrics import RequestRecord


@dataclass
class _Stream:
    """What has arrived so far on one response (perf_counter times)."""

    chunk_times: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    usage_tokens: int | None = None
    error: str = ""


def chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    """The text a streamed chunk carries ("" for a usage-only or role-only chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("reasoning_content") or delta.get("reasoning") or "") + (
        delta.get("content") or ""
    )


def chunk_error(chunk: dict[str, Any]) -> str | None:
    """The error message of an error event (``{"error": ...}`` or ``{"object": "error"}``)."""
    if "error" in chunk and chunk["error"]:
        err = chunk["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    if chunk.get("object") == "error":
        return str(chunk.get("message", chunk))
    return None


async def _consume(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool, s: _Stream
) -> None:
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", errors="replace")
            s.error = f"HTTP {response.status_code}: {text[:500]}"
            return
        async for line in response.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, "event:" lines
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                s.error = f"malformed SSE data: {payload[:200]}"
                return
            if (err := chunk_error(chunk)) is not None:
                s.error = err
                return
            if text := chunk_text(chunk, chat):
                s.chunk_times.append(now)
                s.texts.append(text)
            usage = chunk.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                s.usage_tokens = int(usage["completion_tokens"])


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    chat: bool,
    prompt_len: int,
    t0: float,
    timeout: float,
) -> RequestRecord:
    """POST ``body`` (with ``stream: true``) to ``url`` and time the stream.

    Never raises for a server or network failure: those give a record with ``success=False``.
    Times in the record are relative to ``t0`` (a ``time.perf_counter()`` value).
    """
    s = _Stream()
    st = time.perf_counter()
    try:
        await asyncio.wait_for(_consume(client, url, body, chat, s), timeout)
    except asyncio.TimeoutError:
        s.error = f"timed out after {timeout:g} s"
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    end = time.perf_counter()
    if not s.error and not s.chunk_times:
        s.error = "the stream carried no text (no chunk to measure TTFT from)"
    if s.error:
        return RequestRecord(
            success=False, prompt_len=prompt_len, start=st - t0, e2e=end - st, error=s.error
        )
    times = s.chunk_times
    return RequestRecord(
        success=True,
        prompt_len=prompt_len,
        output_len=s.usage_tokens if s.usage_tokens is not None else len(times),
        start=st - t0,
        ttft=times[0] - st,
        e2e=end - st,
        itl=tuple(b - a for a, b in zip(times, times[1:])),
        chunk_times=tuple(t - t0 for t in times),
        generated_text="".join(s.texts),
    )
