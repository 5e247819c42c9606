"""What every tool-call format gives, and the stream of OpenAI deltas made from it.

A format reads the text so far into a :class:`Scan`: the content before the first call,
the calls whose name is known (each with the argument text seen so far and whether it is
complete), and whether the text is malformed. The stream scans the whole text after every
delta and sends only what is new, so no format needs its own incremental code::

    text so far --scan--> content, [(name, args so far, complete), ...]
                          new content        -> delta.content
                          a new call's name  -> delta.tool_calls[{index, id, type, function:
                                                {name, arguments: ""}}]
                          more argument text -> delta.tool_calls[{index, function:
                                                {arguments: fragment}}]

Content that is only whitespace waits: before a call it is no content at all. At the end
(:meth:`ToolCallStream.finish`) a call that never completed, or arguments that are not a
JSON object, make the text plain content (what the stream had not sent yet).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """One call in OpenAI's shape: ``arguments`` is the JSON text of the arguments."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ScannedCall:
    name: str
    arguments: str  # the argument text seen so far
    complete: bool


@dataclass(frozen=True)
class Scan:
    content: str  # before the first call (a tail that may begin a call's marker held back)
    calls: list[ScannedCall]
    malformed: bool = False


class ToolFormat:
    """One model family's tool-call text (subclasses: :meth:`scan`)."""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedMessage:
        """The calls of a finished message; its whole text as content when it has none or
        they are malformed."""
        s = self.scan(text, final=True)
        if not _well_formed(s):
            return ParsedMessage(text or None, [])
        calls = [ToolCall(c.name, c.arguments.strip()) for c in s.calls]
        # the text before the calls, unless it is only whitespace (R1's "\n\n" after its
        # thinking section): what the stream sends too
        return ParsedMessage(s.content if s.content.strip() else None, calls)


class ToolCallStream:
    """One sample's deltas (see the module's doc)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._text = ""
        self._content_sent = 0
        self._calls: list[tuple[str, int]] = []  # (id, argument characters sent) per call
        self._fallen_back = False

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """``(content, tool_call deltas)`` that ``delta`` adds."""
        self._text += delta
        if self._fallen_back:
            return delta, []
        return self._diff(self.fmt.scan(self._text, final=False))

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the sample ended: the rest, or the unsent text as content when
        the calls turned out malformed."""
        if self._fallen_back:
            return "", []
        s = self.fmt.scan(self._text, final=True)
        if not _well_formed(s):  # no calls, or malformed after all: the rest is text
            return self._text[self._content_sent :], []
        return self._diff(s)

    @property
    def called(self) -> bool:
        """Whether any tool call was sent."""
        return bool(self._calls)

    def _diff(self, s: Scan) -> tuple[str, list[dict]]:
        if s.malformed:
            self._fallen_back = not self._calls
            if self._fallen_back:
                rest = self._text[self._content_sent :]
                self._content_sent = len(self._text)
                return rest, []
            return "", []
        content = ""
        # whitespace alone waits: before a call it is no content (as in parse)
        if not self._calls and len(s.content) > self._content_sent and s.content.strip():
            content = s.content[self._content_sent :]
            self._content_sent = len(s.content)
        out = []
        for i, call in enumerate(s.calls):
            if i == len(self._calls):
                call_id = ToolCall(call.name, "").id
                self._calls.append((call_id, 0))
                out.append({
                    "index": i, "id": call_id, "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                })  # fmt: skip
            call_id, sent = self._calls[i]
            args = call.arguments.strip() if call.complete else call.arguments.lstrip()
            if len(args) > sent:
                out.append({"index": i, "function": {"arguments": args[sent:]}})
                self._calls[i] = (call_id, len(args))
        return content, out


def _well_formed(s: Scan) -> bool:
    """Whether a finished text's scan holds calls, each complete with a JSON object."""
    return (
        not s.malformed
        and bool(s.calls)
        and all(c.complete and _is_object(c.arguments) for c in s.calls)
    )


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
