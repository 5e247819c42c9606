"""Chat templates sent by a request render in a separate process, within a budget.

A template in ``chat_template`` (or ``chat_template_kwargs.chat_template``) is code from the
client. jinja's sandbox keeps it away from Python's internals, but not from the CPU or memory:
three nested ``range(1000)`` loops run for a minute, ``'x'|center(2**62)`` asks for exabytes.
So the server takes such templates only with ``--trust-request-chat-template``, and even then
renders them here, in one worker process (started at the first such request) that

- stops a render after ``timeout_s`` (an interval timer in the worker; the server kills the
  worker if it does not answer a second later, and starts a new one for the next request),
- holds at most ``max_memory_bytes`` of address space (a larger allocation fails as a
  MemoryError, answered as a 400),
- stops a render whose output passes ``max_output_chars``,
- dies with the server (``PR_SET_PDEATHSIG``; and it exits when its input closes).

Renders queue for the one worker, so a client looping templates delays only the other
requests that bring their own template; the model's own template renders on the API
server's threads (``prompts.py``). Messages are one line of JSON each way.

    python -m moeserve.serving.template_sandbox '<json TemplateBudget>'   (the worker)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import resource
import signal
import sys
from dataclasses import dataclass
from typing import Any

from moeserve.chat_template import ChatTemplateError, render_chat_template
from moeserve.libc import die_with_parent

logger = logging.getLogger(__name__)

_KILL_GRACE_S = 1.0  # beyond timeout_s, before the server kills a worker that did not answer
_LINE_LIMIT = 1 << 30  # bytes of one reply line (the output budget is what bounds it)
_START_TIMEOUT_S = 60.0
_READY = b'{"ready": true}\n'


@dataclass(frozen=True)
class TemplateBudget:
    timeout_s: float = 2.0
    max_output_chars: int = 8 << 20
    max_memory_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.max_output_chars <= 0 or self.max_memory_bytes <= 0:
            raise ValueError(f"every template budget must be > 0, got {self}")


class TemplateSandbox:
    """The server's side: ``await render(...)`` returns the text or raises
    ChatTemplateError (a 400); :meth:`close` stops the worker."""

    def __init__(self, budget: TemplateBudget | None = None) -> None:
        self.budget = budget or TemplateBudget()
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self.restarts = 0  # workers killed for overrunning (for tests and logs)

    async def render(
        self,
        template: str,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list[dict] | None,
        variables: dict[str, Any],
    ) -> str:
        request = {
            "template": template,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "variables": variables,
        }
        line = json.dumps(request).encode() + b"\n"  # ASCII: a lone surrogate stays escaped
        async with self._lock:
            reply = await self._exchange(line)
        if "error" in reply:
            raise ChatTemplateError(reply["error"])
        return reply["text"]

    async def _exchange(self, line: bytes) -> dict:
        proc = await self._worker()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(line)
            await proc.stdin.drain()
            answer = await asyncio.wait_for(
                proc.stdout.readline(), self.budget.timeout_s + _KILL_GRACE_S
            )
        except asyncio.TimeoutError:
            await self._stop(kill=True)
            self.restarts += 1
            raise ChatTemplateError(
                f"the chat template did not finish within {self.budget.timeout_s:g} s"
            ) from None
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            answer = b""
        if not answer:  # the worker died (an allocation the kernel refused, a crash)
            await self._stop(kill=True)
            self.restarts += 1
            raise ChatTemplateError("the chat template ended its sandbox process")
        return json.loads(answer)

    async def _worker(self) -> asyncio.subprocess.Process:
        """The worker, started (and waited for: its start-up is not a render's time) when
        there is none."""
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "moeserve.serving.template_sandbox",
            json.dumps(dataclasses.asdict(self.budget)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=_LINE_LIMIT,
        )
        assert proc.stdout is not None
        try:
            hello = await asyncio.wait_for(proc.stdout.readline(), _START_TIMEOUT_S)
        except asyncio.TimeoutError:
            hello = b""
        if hello != _READY:
            proc.kill()
            await proc.wait()
            raise ChatTemplateError("the chat-template sandbox did not start")
        self._proc = proc
        return proc

    async def _stop(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        if kill:
            proc.kill()
        elif proc.stdin is not None:
            proc.stdin.close()  # the worker exits at the end of its input
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()

    async def close(self) -> None:
        async with self._lock:
            await self._stop(kill=False)


# -- the worker process ---------------------------------------------------------------------


class _Overrun(BaseException):
    """Raised by the interval timer inside a render; a BaseException, so that the render's
    own ``except Exception`` (which turns template failures into ChatTemplateError) passes it."""


def _limit_self(budget: TemplateBudget) -> None:
    die_with_parent(signal.SIGKILL)
    resource.setrlimit(resource.RLIMIT_AS, (budget.max_memory_bytes, budget.max_memory_bytes))

    def overrun(signum, frame) -> None:
        raise _Overrun()

    signal.signal(signal.SIGALRM, overrun)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when this process ends


def _render_one(request: dict, budget: TemplateBudget) -> dict:
    signal.setitimer(signal.ITIMER_REAL, budget.timeout_s)
    try:
        text = render_chat_template(
            request["template"],
            request["messages"],
            request["add_generation_prompt"],
            request["tools"],
            request["variables"],
            max_output_chars=budget.max_output_chars,
        )
        return {"text": text}
    except _Overrun:
        return {"error": f"the chat template did not finish within {budget.timeout_s:g} s"}
    except ChatTemplateError as e:
        return {"error": str(e)}
    except MemoryError:
        return {"error": "the chat template ran out of memory"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main(argv: list[str]) -> int:
    budget = TemplateBudget(**json.loads(argv[1]))
    _limit_self(budget)
    sys.stdout.buffer.write(_READY)
    sys.stdout.buffer.flush()
    for line in sys.stdin.buffer:
        try:
            reply = _render_one(json.loads(line), budget)
        except _Overrun:  # the timer fired between the render and its cancellation
            reply = {"error": f"the chat template did not finish within {budget.timeout_s:g} s"}
        except (ValueError, KeyError, TypeError) as e:
            reply = {"error": f"bad sandbox request: {type(e).__name__}"}
        try:
            out = json.dumps(reply).encode() + b"\n"
        except MemoryError:
            out = b'{"error": "the chat template ran out of memory"}\n'
        sys.stdout.buffer.write(out)
        sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
