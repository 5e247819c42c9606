"""Structured output in the engine (offline ``LLM``): constrained and free requests share
batches without touching each other, every constrained output is in its grammar, and MTP
speculation leaves greedy constrained outputs unchanged (drafts checked against the grammar:
a draft outside it is rejected, and the matcher keeps only what was accepted)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moeserve import LLM, SamplingParams
from tests.mtp_checkpoint import save_mtp_checkpoint
from tests.unit.spec.test_spec_engine import OracleDrafts

ENGINE = dict(dtype="float32", max_model_len=256, progress=False)
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["moe", "mla", "mtp"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tag", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,6}-[0-9]{2}"


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, 500, (int(m),), generator=g).tolist()
        for m in torch.randint(3, 40, (n,), generator=g)
    ]


BUDGET = 5
SPECS = {
    "json": {"json": SCHEMA},
    "regex": {"regex": REGEX},
    # a thinking section of at most BUDGET tokens, then the regex
    "think": {"regex": REGEX, "thinking": "inside", "thinking_budget": BUDGET},
}


def guided(kind: str, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=60, temperature=0, guided_decoding=SPECS[kind], **kw)


FREE = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def check_outputs(outs, kinds) -> None:
    for o, kind in zip(outs, kinds, strict=True):
        c = o.outputs[0]
        if kind == "json":
            assert c.finish_reason == "stop", c.text
            value = json.loads(c.text)
            assert (
                set(value) == {"id", "tag", "ok"}
                and value["tag"] in SCHEMA["properties"]["tag"]["enum"]
            )
        elif kind == "regex":
            assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c.text
        elif kind == "think":  # (a section of BUDGET tokens, and those that end a character)
            assert c.finish_reason == "stop" and c.text.count("</think>") == 1, c.text
            assert 511 in c.token_ids[: BUDGET + 4], c.token_ids  # the demo's "</think>"
            answer = c.text.split("</think>")[1].lstrip(" \t\n")
            assert re.fullmatch(REGEX, answer), c.text


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "ck")[2]


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(str(ckpt), **ENGINE)
    ps = prompts(6)
    kinds = ["json", "free", "regex", "json", "free", "regex"]
    params = [FREE if k == "free" else guided(k) for k in kinds]
    return ps, kinds, params, llm.generate(ps, params), llm.generate(ps[1::3], FREE)


def test_constrained_and_free_requests_share_batches(reference):
    ps, kinds, params, outs, free_alone = reference
    check_outputs(outs, kinds)
    # the free requests come out as they do alone: the masks touch only their own rows
    mixed_free = [o.outputs[0].token_ids for o, k in zip(outs, kinds) if k == "free"]
    assert mixed_free == [o.outputs[0].token_ids for o in free_alone]


def test_seeded_constrained_sampling_is_reproducible(ckpt):
    llm = LLM(str(ckpt), **ENGINE)
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, guided_decoding={"json": SCHEMA})
        for s in range(4)
    ]
    first = llm.generate(prompts(4, 1), params)
    check_outputs(first, ["json"] * 4)
    again = llm.generate(prompts(4, 1)[::-1], params[::-1])[::-1]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_keep_constrained_greedy_outputs(ckpt, reference, k):
    ps, kinds, params, outs, _ = reference
    want = [o.outputs[0].token_ids for o in outs]
    llm = LLM(str(ckpt), speculative_num_tokens=k, **ENGINE)
    # drafts that are mostly the right continuation, some wrong (inside the grammar or not)
    runner = llm.engine.runner
    runner.proposer = OracleDrafts(runner.proposer, {tuple(p): w for p, w in zip(ps, want)}, 3)
    got = llm.generate(ps, params)
    assert [o.outputs[0].token_ids for o in got] == want
    stats = llm.engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_min_tokens_yields_to_a_complete_grammar(ckpt):
    """A grammar complete before min_tokens allows only EOS: the request ends there, with
    the whole answer (min_tokens would otherwise leave no token to sample)."""
    llm = LLM(str(ckpt), **ENGINE)
    params = SamplingParams(
        max_tokens=40, min_tokens=30, temperature=0, guided_decoding={"choice": ["yes", "no"]}
    )
    (out,) = llm.generate(prompts(1, 3), params)
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


def test_a_thinking_budget_under_mtp_drafts(ckpt):
    """The budget's ``</think>`` comes after at most that many tokens (and the few that
    finish a UTF-8 character: this model writes byte tokens), the answer after it is held,
    and MTP drafts (checked against the grammar and the count) leave the greedy outputs as
    they are."""
    ps, params = prompts(4, 5), guided("think")
    llm = LLM(str(ckpt), **ENGINE)
    assert llm.get_tokenizer().added_token_id("</think>") == 511
    want = llm.generate(ps, params)
    check_outputs(want, ["think"] * 4)
    mtp = LLM(str(ckpt), speculative_num_tokens=2, **ENGINE)
    got = mtp.generate(ps, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
