"""DeepSeek's tool-call tokens, as its chat templates write them::

    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                  ```json
                  ARGS
                  ```<｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>          (V3, V3-0324, R1)
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
                  <｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>             (V3.1)

Arguments stream as they arrive; the end of what arrived is held back while it may still
begin the call's closing text.
"""

from __future__ import annotations

from moeserve.serving.tool_parsers.base import Scan, ScannedCall, ToolFormat
from moeserve.text_tracker import partial_tag

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


class DeepSeekV3(ToolFormat):
    fenced = True  # V3: ``function<sep>NAME\n```json\nARGS\n```<end>``

    def scan(self, text: str, final: bool) -> Scan:
        at = text.find(CALLS_BEGIN)
        if at < 0:
            keep = 0 if final else partial_tag(text, CALLS_BEGIN)
            return Scan(text[: len(text) - keep], [])
        rest, calls = text[at + len(CALLS_BEGIN) :], []
        while True:
            rest = rest.lstrip()
            if not rest or rest.startswith(CALLS_END):
                break
            if not rest.startswith(CALL_BEGIN):
                if not final and (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
                    break
                return Scan(text[:at], calls, malformed=True)
            call, rest = self._call(rest[len(CALL_BEGIN) :], final)
            if call is None:  # the name is not complete yet, or (final) never was
                return Scan(text[:at], calls, malformed=final)
            calls.append(call)
            if not call.complete:
                break
        return Scan(text[:at], calls)

    def _call(self, body: str, final: bool) -> tuple[ScannedCall | None, str]:
        """One call after its begin token: the call (None while its name is unknown) and
        the text after it."""
        sep = body.find(SEP)
        if sep < 0:
            return None, ""
        if self.fenced:
            after = body[sep + len(SEP) :]
            nl = after.find("\n")
            if nl < 0:
                return None, ""
            name, args_text, opener = after[:nl].strip(), after[nl + 1 :], "```json"
            if args_text.startswith(opener):
                args_text = args_text[len(opener) :]
            elif opener.startswith(args_text) and not final:
                args_text = ""
        else:
            name, args_text = body[:sep].strip(), body[sep + len(SEP) :]
        end = args_text.find(CALL_END)
        if end >= 0:
            args = args_text[:end].rstrip()
            if self.fenced and args.endswith("```"):
                args = args[:-3]
            return ScannedCall(name, args, True), args_text[end + len(CALL_END) :]
        closing = ("\n```" if self.fenced else "") + CALL_END
        keep = partial_tag(args_text, closing) if not final else 0
        return ScannedCall(name, args_text[: len(args_text) - keep], False), ""


class DeepSeekV31(DeepSeekV3):
    fenced = False  # V3.1: ``NAME<sep>ARGS<end>``
