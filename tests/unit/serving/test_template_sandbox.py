"""Request templates render in a sandbox process with a time, memory and output budget; every
failure is one ChatTemplateError line, and a worker that overran is replaced."""

from __future__ import annotations

import asyncio
import time

import pytest

from moeserve.chat_template import ChatTemplateError, render_chat_template
from moeserve.serving.template_sandbox import TemplateBudget, TemplateSandbox

CHAT = [{"role": "user", "content": "hi"}]
LOOPS = (
    "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
    "{% endfor %}{% endfor %}{% endfor %}x"
)
FAILING = {
    "{{ 1/0 }}": "ZeroDivisionError",
    "{{ range(0,1,0) }}": "ValueError",
    "{{ 'x'|truncate(-1) }}": "AssertionError",
    "{{ 'x'|center(2**62) }}": "MemoryError",
    "{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}": "RecursionError",
    "{% for %}": "does not parse",
    "{{ ''.__class__.__mro__ }}": "unsafe",
}


def _run(coro):
    return asyncio.run(coro)


async def _render_all(sandbox: TemplateSandbox, templates) -> list:
    out = []
    for t in templates:
        try:
            out.append(await sandbox.render(t, CHAT, True, None, {"bos_token": "<s>"}))
        except ChatTemplateError as e:
            out.append(e)
    await sandbox.close()
    return out


def test_renders_like_the_in_process_renderer():
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    (text,) = _run(_render_all(TemplateSandbox(), [template]))
    assert text == render_chat_template(template, CHAT, True, None, {"bos_token": "<s>"})


def test_every_failure_is_one_short_error():
    results = _run(_render_all(TemplateSandbox(), list(FAILING)))
    for (template, expected), got in zip(FAILING.items(), results):
        assert isinstance(got, ChatTemplateError), (template, got)
        assert expected in str(got) and "\n" not in str(got) and len(str(got)) < 400, got


def test_time_output_and_memory_budgets():
    budget = TemplateBudget(timeout_s=0.5, max_output_chars=1000, max_memory_bytes=512 << 20)
    sandbox = TemplateSandbox(budget)
    templates = [LOOPS, "{{ 'x' * 1001 }}", "{{ 'x' * 600000000 }}", "{{ 'x' * 999 }}"]
    t0 = time.monotonic()
    results = _run(_render_all(sandbox, templates))
    assert time.monotonic() - t0 < 10
    assert "did not finish within 0.5 s" in str(results[0])
    assert "exceeds 1000 characters" in str(results[1])
    assert "MemoryError" in str(results[2]) or "out of memory" in str(results[2])
    assert results[3] == "x" * 999  # the same worker, still serving


def test_a_worker_that_does_not_answer_is_replaced(monkeypatch):
    # the worker's own timer is what normally ends a render; here it is too late, so the
    # server's deadline (timeout + 1 s) kills the worker and the next render gets a new one
    sandbox = TemplateSandbox(TemplateBudget(timeout_s=0.3))
    monkeypatch.setattr("moeserve.serving.template_sandbox._KILL_GRACE_S", -0.2)
    results = _run(_render_all(sandbox, [LOOPS, "ok"]))
    assert "did not finish" in str(results[0]) and results[1] == "ok"
    assert sandbox.restarts == 1


@pytest.mark.parametrize("bad", [{"a": 1}, -1.0])
def test_budget_is_checked(bad):
    with pytest.raises((ValueError, TypeError)):
        TemplateBudget(timeout_s=bad)  # type: ignore[arg-type]
