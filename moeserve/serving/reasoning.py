"""The thinking section of a reasoning model's answer, split into ``reasoning_content``
(``--reasoning-parser``, vLLM's and SGLang's names), in one piece or delta by delta.

    deepseek_r1   the chat template opens ``<think>`` in the prompt, so the output starts
                  inside the thinking section (a ``<think>`` the model writes anyway is
                  dropped); it ends at ``</think>``. No ``</think>``: all of it is reasoning
                  (a section cut by ``max_tokens`` stays reasoning). A prompt that closed the
                  section itself (thinking turned off) makes everything content.
    qwen3         the model opens ``<think>`` itself (leading whitespace aside) when thinking
                  is on; without it everything is content (``enable_thinking: false``). A
                  template that opened it in the prompt works as for deepseek_r1.

A splitter runs one sample's text through a small state machine::

    undecided --"<think>"--> reasoning --"</think>"--> content
        \\--------- anything else ---------------------^

It holds back only what may still become a tag (``"</thi"`` at the end of a delta), so a
stream's deltas concatenate to exactly the one-piece split, and it never raises on model
output: an unclosed or stray tag is text.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.guided import THINK_END as END
from moeserve.guided import THINK_START as START
from moeserve.text_tracker import partial_tag

PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class Split:
    """What a piece of output adds to each part (empty strings: nothing)."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """One sample's split (see the module's doc). ``prompt_tail``: the end of the rendered
    prompt, which says whether the template opened or closed the thinking section."""

    def __init__(self, parser: str, prompt_tail: str = "") -> None:
        self.mode = {"": "content", "inside": "opening", "optional": "undecided"}[
            thinking_mode(parser, prompt_tail)
        ]  # opening: inside, though the model may write <think> once more
        self._held = ""

    def feed(self, text: str) -> Split:
        """The parts ``text`` (the next delta) adds; text that may be part of a tag waits."""
        self._held += text
        reasoning, content = [], []
        while True:
            held = self._held
            if self.mode == "content":
                content.append(held)
                self._held = ""
                break
            if self.mode in ("undecided", "opening"):
                stripped = held.lstrip()
                if stripped.startswith(START):
                    self._held, self.mode = stripped[len(START) :], "reasoning"
                    continue
                if START.startswith(stripped):  # still may be the tag (or only whitespace)
                    break
                self.mode = "content" if self.mode == "undecided" else "reasoning"
                continue
            # reasoning: up to </think>, holding back a tail that may begin it
            at = held.find(END)
            if at >= 0:
                reasoning.append(held[:at])
                self._held, self.mode = held[at + len(END) :], "content"
                continue
            keep = partial_tag(held, END)
            reasoning.append(held[: len(held) - keep])
            self._held = held[len(held) - keep :]
            break
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """What was held back, once the sample ended: text, in the part it was in."""
        held, self._held = self._held, ""
        if self.mode in ("reasoning", "opening"):
            return Split(reasoning=held)
        return Split(content=held)


def thinking_mode(parser: str, prompt_tail: str) -> str:
    """Where the output starts: "inside" a thinking section, "optional" (the model may open
    one), or "" (the template closed it: thinking is off). The structured output of such a
    request holds what follows the section (``GuidedDecodingParams.thinking``)."""
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; choose {', '.join(PARSERS)}")
    tail = prompt_tail.rstrip()
    if tail.endswith(END):
        return ""
    if tail.endswith(START) or parser == "deepseek_r1":
        return "inside"
    return "optional"


def split_whole(parser: str, text: str, prompt_tail: str = "") -> tuple[str | None, str | None]:
    """``(reasoning_content, content)`` of a finished sample (None for an empty part)."""
    s = ReasoningSplitter(parser, prompt_tail)
    a, b = s.feed(text), s.finish()
    reasoning, content = a.reasoning + b.reasoning, a.content + b.content
    return reasoning or None, content or None
