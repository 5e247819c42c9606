"""Whatever a chat template raises on its input is one ChatTemplateError line (a 400 in the
server), and inputs nested deeper than MAX_INPUT_DEPTH are refused before rendering."""

from __future__ import annotations

import pytest

from moeserve.chat_template import MAX_INPUT_DEPTH, ChatTemplateError, render_chat_template

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{{ 1/0 }}", "ZeroDivisionError"),
        ("{{ range(0,1,0) }}", "ValueError"),
        ("{{ (1e308*10)|int }}", "chat template failed"),
        ("{{ 'x'|truncate(-1) }}", "AssertionError"),
        ("{{ 'x'|center(2**62) }}", "chat template failed"),
        ("{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
        ("{{ raise_exception('no tools here') }}", "no tools here"),
        ("{% for %}", "does not parse"),
        ("{% if x %}" * 3000, "does not parse"),
    ],
)
def test_template_failures_are_one_line(template, expected):
    with pytest.raises(ChatTemplateError) as e:
        render_chat_template(template, CHAT, True, None, {})
    assert expected in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400


def test_output_budget():
    with pytest.raises(ChatTemplateError, match="exceeds 10 characters"):
        render_chat_template("{% for i in range(5) %}abc{% endfor %}", CHAT, True, None, {}, 10)
    out = render_chat_template("{% for i in range(3) %}abc{% endfor %}", CHAT, True, None, {}, 10)
    assert out == "abcabcabc"


def test_nesting_and_clashing_variables():
    deep: dict = {}
    for _ in range(MAX_INPUT_DEPTH):
        deep = {"a": deep}
    with pytest.raises(ChatTemplateError, match="nest deeper"):
        render_chat_template("{{ x }}", CHAT, True, None, {"x": deep})
    assert render_chat_template("{{ x.a.a }}", CHAT, True, None, {"x": deep["a"]["a"]})
    with pytest.raises(ChatTemplateError, match="cannot override messages"):
        render_chat_template("{{ messages }}", CHAT, True, None, {"messages": []})
