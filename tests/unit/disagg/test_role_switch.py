"""Adaptive P/D's switch on one engine: two engines swap roles once drained, and serve
exactly as before in the new ones (real Mooncake on loopback)."""

from __future__ import annotations

import random

import pytest

from moeserve.core import KVTransferParams, SamplingParams
from moeserve.demo import tiny_model_path
from moeserve.disagg.connector import NotDrainedError
from tests.unit.disagg.test_connector import (
    GREEDY,
    HOST,
    assert_idle,
    assert_same,
    colocated,
    drive,
    engine,
    free_port,
    tokens,
)


@pytest.fixture(scope="module")
def engines():
    model = str(tiny_model_path())
    a = engine(model, "prefill")
    b = engine(model, "decode", disaggregation_bootstrap_port=free_port())
    c = engine(model)
    yield a, b, c
    for e in (a, b, c):
        e.shutdown()


def _serve(prefill, decode, rid: str, prompt: list[int], room: int):
    kv = KVTransferParams(HOST, prefill.config.disaggregation_bootstrap_port, room)
    params = SamplingParams(**GREEDY, kv_transfer=kv)
    prefill.add_tokenized(rid, prompt, params)
    decode.add_tokenized(rid, prompt, params)
    return drive([prefill, decode], 60)[1][rid]


def test_two_engines_swap_roles_and_still_equal_colocated(engines):
    a, b, c = engines
    rng = random.Random(3)
    prompts = {"before": tokens(rng, 40), "after": tokens(rng, 40)}
    want = colocated(c, prompts)
    assert_same(_serve(a, b, "before", prompts["before"], 7001), want["before"])
    # not drained: a request queued on the prefill side keeps its role
    a.add_tokenized("busy", prompts["after"], SamplingParams(**GREEDY))
    with pytest.raises(NotDrainedError, match="not drained"):
        a.set_disaggregation_mode("decode")
    a.abort_request("busy")
    with pytest.raises(ValueError, match="'prefill' or 'decode'"):
        a.set_disaggregation_mode("null")
    info_a = a.set_disaggregation_mode("decode")
    info_b = b.set_disaggregation_mode("prefill")
    assert info_a["disaggregation_mode"] == "decode"
    assert info_b["disaggregation_bootstrap_port"] == b.config.disaggregation_bootstrap_port
    assert_same(_serve(b, a, "after", prompts["after"], 7002), want["after"])
    # the counters carried over the switch (Prometheus counters never go down)
    assert a.stats()["disaggregation"]["transfers"] == 2
    assert b.stats()["disaggregation"]["role"] == "prefill"
    assert_idle(a, b, c)


def test_a_colocated_engine_cannot_switch(engines):
    with pytest.raises(ValueError, match="colocated"):
        engines[2].set_disaggregation_mode("prefill")
