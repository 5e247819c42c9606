"""One chat sample's text as the answer's parts: ``reasoning_content`` (with
``--reasoning-parser``), then, in what is left, ``tool_calls`` (when the request's tools are
read: ``serving/tools.py``) and ``content``; whole (:func:`read_whole`) or delta by delta
(:class:`AnswerStream`, whose deltas add up to the whole)::

    text -> ReasoningSplitter -> reasoning_content
                     \\-> the rest -> ToolCallStream -> tool_calls deltas, content
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.serving.reasoning import ReasoningSplitter, split_whole
from moeserve.serving.tool_parsers import ToolCallStream, ToolFormat


@dataclass(frozen=True)
class Answer:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict] | None = None  # OpenAI's {id, type, function: {name, arguments}}


def read_whole(
    text: str, reasoning_parser: str | None, prompt_tail: str, fmt: ToolFormat | None
) -> Answer:
    reasoning, content = None, text
    if reasoning_parser is not None:
        reasoning, content = split_whole(reasoning_parser, text, prompt_tail)
    if fmt is None or not content:
        return Answer(content, reasoning)
    parsed = fmt.parse(content)
    calls = [c.to_openai() for c in parsed.tool_calls] or None
    return Answer(parsed.content, reasoning, calls)


@dataclass
class AnswerDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class AnswerStream:
    """One sample's stream of answer deltas."""

    def __init__(
        self, reasoning_parser: str | None, prompt_tail: str, fmt: ToolFormat | None
    ) -> None:
        self._split = ReasoningSplitter(reasoning_parser, prompt_tail) if reasoning_parser else None
        self._tools = ToolCallStream(fmt) if fmt is not None else None

    @property
    def called(self) -> bool:
        """Whether tool calls were sent (the finish reason is then ``tool_calls``)."""
        return self._tools is not None and self._tools.called

    def feed(self, text: str, finished: bool) -> AnswerDelta:
        """The parts ``text`` (the next delta) adds; ``finished``: the sample ended with it."""
        out = AnswerDelta()
        rest = text
        if self._split is not None:
            part = self._split.feed(text)
            out.reasoning, rest = part.reasoning, part.content
            if finished:
                end = self._split.finish()
                out.reasoning += end.reasoning
                rest += end.content
        if self._tools is None:
            out.content = rest
            return out
        out.content, out.tool_calls = self._tools.feed(rest)
        if finished:
            content, calls = self._tools.finish()
            out.content += content
            out.tool_calls += calls
        return out
