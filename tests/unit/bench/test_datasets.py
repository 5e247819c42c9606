"""Benchmark request sources with the demo tokenizer: random lengths, seeds, JSONL files."""

from __future__ import annotations

import json

import pytest

from moeserve.bench.datasets import (
    DatasetError,
    LocalCodec,
    build_requests,
    length_bounds,
    load_jsonl,
    random_requests,
)
from moeserve.demo import write_demo_tokenizer


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    return LocalCodec.from_dir(write_demo_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize(
    "mean, ratio, bounds",
    [(100, 0.0, (100, 100)), (100, 0.5, (50, 150)), (10, 0.25, (7, 13)), (1, 0.9, (1, 2))],
)
def test_length_bounds(mean, ratio, bounds):
    assert length_bounds(mean, ratio) == bounds


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_range_ratio_must_be_in_0_1(ratio):
    with pytest.raises(DatasetError, match="range-ratio"):
        length_bounds(10, ratio)


def test_random_lengths_within_range_ratio(codec):
    reqs = random_requests(codec, 40, input_len=40, output_len=20, range_ratio=0.5, seed=3)
    assert len(reqs) == 40
    out_lens = [r.output_len for r in reqs]
    assert all(10 <= n <= 30 for n in out_lens)
    assert len(set(out_lens)) > 5  # actually drawn from the range
    for r in reqs:
        # the drawn input length lies in [20, 60]; the text is fitted to it within one token
        assert 19 <= r.prompt_len <= 61
        assert r.prompt_len == len(codec.encode(r.prompt))
        assert r.messages is None


def test_random_prompts_hit_the_length_and_avoid_special_tokens(codec):
    reqs = random_requests(codec, 10, input_len=64, output_len=8, seed=0)
    assert all(abs(r.prompt_len - 64) <= 1 for r in reqs)
    assert all(r.output_len == 8 for r in reqs)
    special = codec.special_ids
    assert special  # the demo tokenizer has BOS/EOS/User/Assistant
    assert not any(set(codec.encode(r.prompt)) & special for r in reqs)
    assert len({r.prompt for r in reqs}) == 10


def test_random_is_deterministic_in_the_seed(codec):
    a = random_requests(codec, 8, 32, 16, 0.3, seed=7)
    b = random_requests(codec, 8, 32, 16, 0.3, seed=7, workers=1)
    c = random_requests(codec, 8, 32, 16, 0.3, seed=8)
    assert a == b
    assert a != c


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_prompts_messages_and_output_len(codec, tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "Hello there", "output_len": 5}),
            "",
            json.dumps({"messages": [{"role": "user", "content": "Hi"}]}),
        ],
    )
    reqs = load_jsonl(path, codec, num_prompts=2, default_output_len=9)
    assert reqs[0].prompt == "Hello there" and reqs[0].output_len == 5
    assert reqs[0].prompt_len == len(codec.encode("Hello there"))
    assert reqs[1].messages == ({"role": "user", "content": "Hi"},)
    assert reqs[1].output_len == 9 and reqs[1].prompt_len == len(codec.encode("Hi"))
    # a shorter file is repeated in order; build_requests dispatches on the path
    more = build_requests(str(path), codec, num_prompts=5, input_len=1, output_len=9)
    assert [r.output_len for r in more] == [5, 9, 5, 9, 5]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", r"d\.jsonl:2: not valid JSON"),
        ("[1, 2]", r"d\.jsonl:2: expected a JSON object"),
        ('{"output_len": 3}', r'd\.jsonl:2: expected exactly one of "prompt" or "messages"'),
        ('{"prompt": "a", "messages": []}', "exactly one of"),
        ('{"prompt": 3}', r'd\.jsonl:2: "prompt" must be a string'),
        ('{"prompt": "a", "output_len": 0}', r'd\.jsonl:2: "output_len" must be a positive'),
        ('{"prompt": "a", "output_len": "5"}', '"output_len" must be a positive'),
        ('{"prompt": "a", "output_len": true}', '"output_len" must be a positive'),
        ('{"messages": []}', r'd\.jsonl:2: "messages" must be a non-empty list'),
        ('{"messages": [{"role": "user"}]}', r"d\.jsonl:2: messages\[0\] must be an object"),
    ],
)
def test_jsonl_errors_name_the_line(codec, tmp_path, bad, message):
    path = _write(tmp_path / "d.jsonl", ['{"prompt": "ok"}', bad])
    with pytest.raises(DatasetError, match=message):
        load_jsonl(path, codec, num_prompts=10, default_output_len=4)


def test_jsonl_missing_or_empty_file(codec, tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_jsonl(tmp_path / "nope.jsonl", codec, 1, 4)
    with pytest.raises(DatasetError, match="holds no requests"):
        load_jsonl(_write(tmp_path / "e.jsonl", ["", "  "]), codec, 1, 4)
