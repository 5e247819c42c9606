"""MTP speculative decoding under parallel layouts: greedy outputs identical to one process
without MTP. The replica leader holds the (unsharded) MTP layer, drafts for its replica and
broadcasts the drafts with the sampled tokens; every rank's scheduler verifies the same
drafts, and every rank checks its KV cache at the stop."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from tests.mtp_checkpoint import save_mtp_checkpoint

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
ENGINE = dict(dtype="float32", progress=False, max_model_len=160, max_num_batched_tokens=40)
LAYOUTS = {
    "ep2-dp2": dict(data_parallel_size=2, enable_expert_parallel=True),
    "ep2-tp2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
}


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 70, (n,), generator=g).tolist()
    return [torch.randint(2, 512, (m,), generator=g).tolist() for m in lengths]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "ck")[2]


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(str(ckpt), max_num_seqs=3, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS)]


@pytest.mark.parametrize(
    ("layout", "k"),
    [
        ("ep2-dp2", 2),
        pytest.param("ep2-dp2", 1, marks=pytest.mark.slow),
        pytest.param("ep2-dp2", 3, marks=pytest.mark.slow),
        ("ep2-tp2", 3),
    ],
)
def test_spec_layout_matches_one_process(ckpt, reference, layout, k):
    llm = LLM(str(ckpt), max_num_seqs=3, speculative_num_tokens=k, **ENGINE, **LAYOUTS[layout])
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS)]
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert got == reference
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert all(p.returncode == 0 for p in llm.engine.workers.procs.values())
