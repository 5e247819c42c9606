"""Adaptive P/D on an engine group: ``EngineGroup.set_disaggregation_mode`` replaces the control
on rank 0 and sends ``{cmd: kv_mode}`` to every rank, whose engine then reports the new role
(``rank_info``); a busy group, a bad role and a colocated group are refused. Two TP ranks on
the demo checkpoint, the second spawned as a process (gloo over loopback), each with its pool
registered with Mooncake."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams
from moeserve.demo import tiny_model_path
from moeserve.disagg.connector import NotDrainedError
from moeserve.launch.spec import free_port

HOST = "127.0.0.1"
ENGINE = dict(
    dtype="float32",
    progress=False,
    num_threads=1,
    max_model_len=128,
    max_num_seqs=4,
    tensor_parallel_size=2,
)
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
PROMPT = list(range(4, 20))


def modes(group) -> list[str]:
    """Every rank's engine's role, in rank order."""
    return [r["disaggregation_mode"] for r in group.rank_info()]


def generate(group, request_id: str) -> list[int]:
    """A request without bootstrap fields (it runs whole here, in any role) to its end."""
    group.add_request(request_id, PROMPT, PARAMS)
    while True:
        for out in group.step():
            if out.request_id == request_id and out.finished:
                assert out.error is None, out.error
                return out.outputs[0].token_ids


@pytest.fixture
def group():
    """A prefill group; gone before the next test starts one (one group per process)."""
    port = free_port()
    llm = LLM(
        str(tiny_model_path()),
        **ENGINE,
        disaggregation_mode="prefill",
        disaggregation_host=HOST,
        disaggregation_bootstrap_port=port,
    )
    yield llm.engine
    llm.shutdown()


def test_a_switch_reaches_every_rank(group):
    port = group.config.disaggregation_bootstrap_port
    assert modes(group) == ["prefill", "prefill"]
    before = generate(group, "before")
    # not drained: a request queued for the next step keeps the role
    group.add_request("busy", PROMPT, PARAMS)
    with pytest.raises(NotDrainedError, match="1 request"):
        group.set_disaggregation_mode("decode")
    group.abort_request("busy")
    with pytest.raises(ValueError, match="'prefill' or 'decode', got 'null'"):
        group.set_disaggregation_mode("null")
    assert modes(group) == ["prefill", "prefill"]

    info = group.set_disaggregation_mode("decode")
    assert info["disaggregation_mode"] == "decode"
    assert modes(group) == ["decode", "decode"]
    assert group.stats()["disaggregation"]["role"] == "decode"
    assert generate(group, "decode-role") == before  # the group still steps in lock step

    info = group.set_disaggregation_mode("prefill")
    assert info["disaggregation_bootstrap_port"] == port  # bound again on the way back
    assert modes(group) == ["prefill", "prefill"]
    assert not group.has_unfinished_requests()


def test_a_colocated_group_is_refused():
    llm = LLM(str(tiny_model_path()), **ENGINE)
    try:
        with pytest.raises(ValueError, match="serves colocated: only one started with"):
            llm.engine.set_disaggregation_mode("prefill")
        assert modes(llm.engine) == ["null", "null"]
        assert not llm.engine.closed  # refused before any command went out
    finally:
        llm.shutdown()
