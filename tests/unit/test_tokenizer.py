from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from moeserve.detokenizer import IncrementalDetokenizer
from moeserve.tokenizer import Tokenizer, TokenizerError
from tests.helpers import copy_demo_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The lighthouse keeper climbed the 112 steps at 18:45.",
    "  two leading spaces, trailing  ",
    "line one\nline two\n\n\tindented",
    "Café naïve résumé Größe",
    "你好，世界！今天天气很好。",
    "日本語とEnglishが混ざった文 and 한국어",
    "emoji 😀🚀🤖 family 👨‍👩‍👧‍👦 flag 🇯🇵 skin 👍🏽",
    "<｜User｜>hi<｜Assistant｜>hello<｜end▁of▁sentence｜>",
    "def f(x):\n    return {'a': [1, 2, 3]}\n",
    "",
]

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And in 中文? 🤔"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return copy_demo_tokenizer(tmp_path_factory.mktemp("demo_tok"))


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("add_special", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf, text, add_special):
    assert (
        tok.encode(text, add_special_tokens=add_special)
        == hf(text, add_special_tokens=add_special).input_ids
    )


def test_encode_adds_bos(tok):
    ids = tok.encode("hi")
    assert ids[0] == tok.bos_token_id == 0
    assert tok.encode("hi", add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok, hf, skip):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        if skip:
            assert tok.decode(ids) == text.replace("<｜User｜>", "").replace(
                "<｜Assistant｜>", ""
            ).replace("<｜end▁of▁sentence｜>", "")
    rng = random.Random(0)  # arbitrary ids: split characters, lone continuation bytes
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 20))]
        assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_post_processor_in_tokenizer_json_wins(tok_dir, tmp_path, add_bos):
    # tokenizer.json adds BOS itself; transformers 5 then ignores the config's flags
    d = _edit_config(tok_dir, tmp_path / "t", add_bos_token=add_bos, add_eos_token=add_bos)
    ours, theirs = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    for text in TEXTS[:4]:
        assert ours.encode(text) == theirs(text).input_ids
    assert ours.encode("x") == [0, ours.encode("x", add_special_tokens=False)[0]]


@pytest.mark.parametrize("add_bos,add_eos", [(True, True), (True, False), (False, None)])
def test_config_flags_apply_without_post_processor(tok_dir, tmp_path, add_bos, add_eos):
    d = _edit_config(tok_dir, tmp_path / "t", add_bos_token=add_bos, add_eos_token=add_eos)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(tj))
    ours = Tokenizer.from_dir(d)
    body = ours.encode("hi there", add_special_tokens=False)
    want = [0] * bool(add_bos) + body + [1] * bool(add_eos)
    assert ours.encode("hi there") == want
    if not add_bos and not add_eos:  # transformers 5 ignores the flags: agree when they are off
        assert transformers.AutoTokenizer.from_pretrained(d)("hi there").input_ids == want


def test_properties(tok, hf):
    assert tok.vocab_size == 512
    assert tok.bos_token_id == hf.bos_token_id == 0
    assert tok.eos_token_id == hf.eos_token_id == 1
    assert tok.eos_token_ids == frozenset({1})
    assert set(hf.all_special_ids) <= tok.all_special_ids == frozenset({0, 1, 2, 3})
    ids = tok.encode("Hello 你好 😀")
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.id_to_piece(ids[1]) == hf.convert_ids_to_tokens(ids[1])
    assert tok.convert_ids_to_tokens(ids, skip_special_tokens=True) == tok.convert_ids_to_tokens(
        ids[1:]
    )


def test_generation_config_eos_list(tok_dir, tmp_path):
    d = shutil.copytree(tok_dir, tmp_path / "t")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 2]}))
    assert Tokenizer.from_dir(d).eos_token_ids == frozenset({1, 2, 3})


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match=r"expected tokenizer.json in .*: not found"):
        Tokenizer.from_dir(tmp_path)
    assert issubclass(TokenizerError, ValueError)


def test_bad_json_is_one_line_error(tok_dir, tmp_path):
    d = shutil.copytree(tok_dir, tmp_path / "t")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON") as e:
        Tokenizer.from_dir(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, add_generation_prompt):
    for chat in (CHAT, CHAT[1:2], CHAT[:3]):
        ours = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
        theirs = hf.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
    text = tok.apply_chat_template(CHAT)
    assert text.startswith("<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>")
    assert text.endswith("<｜Assistant｜>")
    # the template writes BOS itself: encode without special tokens, as transformers does
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == hf.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert ids.count(tok.bos_token_id) == 1


def test_chat_template_raise_exception(tok):
    with pytest.raises(TokenizerError, match="not function"):
        tok.apply_chat_template([{"role": "function", "content": "42"}])
    with pytest.raises(TokenizerError, match="empty conversation"):
        tok.apply_chat_template([])


CHATML_TOOLS = """{%- if tools %}
<|system|>Tools:
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
{%- endif %}
{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
<|{{ message['role'] }}|>{% generation %}{{ message['content'] }}{% endgeneration %}
{% if message.reasoning_content is defined %}[think:{{ message.reasoning_content }}]{% endif %}
{{ eos_token }}
{% endfor %}
{{ dict(a=1) | tojson }} {{ ns.n }}{{ greeting | default('') }}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_chat_template_jinja_file_and_tools(tok_dir, tmp_path):
    d = shutil.copytree(tok_dir, tmp_path / "t")
    (d / "chat_template.jinja").write_text(CHATML_TOOLS)  # overrides tokenizer_config's
    ours, theirs = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    tools = [
        {
            "type": "function",
            "function": {"name": "weather", "description": "Météo <b>& 天气</b>"},
        }
    ]
    chat = [
        *CHAT,
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "hm", "thinking": "ok", "tool_calls": None},
    ]
    for kw in ({}, {"tools": tools}, {"greeting": "hej"}):
        for agp in (True, False):
            want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=agp, **kw)
            assert ours.apply_chat_template(chat, add_generation_prompt=agp, **kw) == want
    assert "Météo <b>& 天气</b>" in ours.apply_chat_template(chat, tools=tools)


def test_no_chat_template(tok_dir, tmp_path):
    d = _edit_config(tok_dir, tmp_path / "t", chat_template=None)
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_dir(d).apply_chat_template(CHAT)


def test_template_sandboxed(tok):
    evil = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(TokenizerError):
        tok.apply_chat_template(CHAT, chat_template=evil)
    ns_evil = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    with pytest.raises(TokenizerError):
        tok.apply_chat_template(CHAT, chat_template=ns_evil)


# --- incremental detokenization -------------------------------------------------------------

STREAM_TEXTS = [
    "The robot 🤖 said 你好 and then ☕ coffee, très bien! 🎉",
    "👨‍👩‍👧‍👦🇯🇵👍🏽 春眠不觉晓，处处闻啼鸟。",
    "plain ascii with   spaces\nand lines",
    "한국어 العربية हिन्दी ∑∫√",
]


def _stream(tok, prompt_ids, ids, chunks, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas, i = [], 0
    for n in chunks:
        deltas.append(detok.step(ids[i : i + n]))
        i += n
    assert i == len(ids)
    return deltas, detok.flush()


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_one_token_at_a_time(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("User says:")
    deltas, rest = _stream(tok, prompt, ids, [1] * len(ids))
    assert "".join(deltas) + rest == tok.decode(ids) == text
    assert rest == ""
    assert not any("\ufffd" in d for d in deltas)
    if not text.isascii():
        assert any(d == "" for d in deltas)  # some tokens held back half a character


def test_incremental_random_chunks_and_special_tokens(tok):
    rng = random.Random(1)
    ids = tok.encode("<｜Assistant｜>" + STREAM_TEXTS[0] + "<｜end▁of▁sentence｜>", False)
    for skip in (True, False):
        for _ in range(10):
            chunks, left = [], len(ids)
            while left:
                chunks.append(min(left, rng.randrange(1, 4)))
                left -= chunks[-1]
            deltas, rest = _stream(tok, tok.encode("hi"), ids, chunks, skip)
            assert "".join(deltas) + rest == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in d for d in deltas)


def test_incremental_garbage_ids_match_decode(tok):
    rng = random.Random(2)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        deltas, rest = _stream(tok, prompt, ids, [1] * len(ids))
        assert "".join(deltas) + rest == tok.decode(ids)


def test_incremental_prompt_ending_inside_a_character(tok):
    ids = tok.encode("😀😀", add_special_tokens=False)
    assert len(ids) > 2
    deltas, rest = _stream(tok, ids[:1], ids[1:], [1] * (len(ids) - 1))
    assert "".join(deltas) + rest == tok.decode(ids[1:])


def test_flush_emits_trailing_partial_character(tok):
    ok = tok.encode("ok", add_special_tokens=False)
    emoji = tok.encode(" 😀", add_special_tokens=False)
    ids = ok + emoji[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, [], True)
    assert detok.step(ok) == "ok"
    assert detok.step(emoji[:-1]) == ""
    assert detok.flush() == tok.decode(ids)[2:]
    assert detok.flush() == ""
    assert tok.decode(ids).endswith("\ufffd")


def test_config_only_tokens_are_added_like_transformers(tok_dir, tmp_path):
    added = {"content": "<tool>", "special": False, "normalized": False}
    d = _edit_config(
        tok_dir,
        tmp_path / "t",
        unk_token="the",
        sep_token={"__type": "AddedToken", "content": "<sep>", "lstrip": False, "rstrip": False},
        added_tokens_decoder={"600": added},
    )
    ours, theirs = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    text = "the <sep> the <tool> x"
    assert ours.encode(text) == theirs(text).input_ids
    for skip in (True, False):
        ids = ours.encode(text)
        assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert set(theirs.all_special_ids) <= ours.all_special_ids
    assert ours.vocab_size == len(theirs) == 515
