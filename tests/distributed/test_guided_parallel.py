"""Structured output under parallel layouts: the replica leader holds the matchers (and
thinking budgets' counts) and masks before it samples, so greedy constrained outputs are
those of one process, with and without MTP drafts (the requests' grammars cross to every
rank in the step messages)."""

from __future__ import annotations

import pytest

from moeserve import LLM
from tests.unit.grammar.test_guided_engine import (
    ENGINE,
    FREE,
    check_outputs,
    guided,
    prompts,
)

LAYOUTS = {
    "ep2-dp2": dict(data_parallel_size=2, enable_expert_parallel=True),
    "ep2-tp2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
}
KINDS = ["json", "regex", "free", "think", "regex", "json"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.mtp_checkpoint import save_mtp_checkpoint

    return save_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "ck")[2]


def params():
    return [FREE if k == "free" else guided(k) for k in KINDS]


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(str(ckpt), max_num_seqs=3, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(len(KINDS), 2), params())]


@pytest.mark.parametrize(("layout", "k"), [("ep2-dp2", 0), ("ep2-tp2", 0), ("ep2-dp2", 2)])
def test_constrained_outputs_match_one_process(ckpt, reference, layout, k):
    llm = LLM(str(ckpt), max_num_seqs=3, speculative_num_tokens=k, **ENGINE, **LAYOUTS[layout])
    try:
        outs = llm.generate(prompts(len(KINDS), 2), params())
        check_outputs(outs, KINDS)
        assert [o.outputs[0].token_ids for o in outs] == reference
    finally:
        llm.engine.shutdown()
