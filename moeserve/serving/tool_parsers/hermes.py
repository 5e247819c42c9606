"""``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one element per call
(Hermes; the format of Qwen2.5's and Qwen3's chat templates). A call's arguments are sent
once its element is complete (they sit inside its JSON object)."""

from __future__ import annotations

import json

from moeserve.serving.tool_parsers.base import Scan, ScannedCall, ToolFormat
from moeserve.text_tracker import partial_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    def scan(self, text: str, final: bool) -> Scan:
        at = text.find(OPEN)
        if at < 0:
            keep = 0 if final else partial_tag(text, OPEN)
            return Scan(text[: len(text) - keep], [])
        rest, calls = text[at:], []
        while True:
            rest = rest.lstrip()
            if not rest:
                break
            if not rest.startswith(OPEN):
                if not final and OPEN.startswith(rest):
                    break
                return Scan(text[:at], calls, malformed=True)
            end = rest.find(CLOSE)
            if end < 0:
                return Scan(text[:at], calls, malformed=final)
            call = _call(rest[len(OPEN) : end])
            if call is None:
                return Scan(text[:at], calls, malformed=True)
            calls.append(call)
            rest = rest[end + len(CLOSE) :]
        return Scan(text[:at], calls)


def _call(body: str) -> ScannedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ScannedCall(obj["name"], json.dumps(args, ensure_ascii=False), True)
