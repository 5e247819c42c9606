"""``disagg/factory.switch_control`` alone: controls over a real rank (the demo engine's pool
registered with Mooncake) and real bootstrap sockets on 127.0.0.1, switched between the
prefill and decode roles without an engine in the way. A refused switch leaves the old
control serving; a done one closes it and carries its counters over."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from moeserve.config import DisaggregationOptions
from moeserve.core import KVTransferParams, SamplingParams
from moeserve.demo import tiny_model_path
from moeserve.disagg.connector import Control, NotDrainedError, RankInfo
from moeserve.disagg.decode import DecodeControl
from moeserve.disagg.factory import check_switch, make_control, switch_control
from moeserve.disagg.prefill import PrefillControl
from tests.unit.disagg.test_connector import HOST, engine, free_port

MODEL = str(tiny_model_path())
PROMPT = list(range(4, 24))


@pytest.fixture(scope="module")
def ranks():
    """One real rank: a decode engine's pool, registered with the transfer engine."""
    e = engine(MODEL, "decode")
    yield [RankInfo(0, 0, 0, **e.kv_rank.describe())]
    e.shutdown()


def control(ranks, mode: str, port: int | None = None) -> Control:
    options = DisaggregationOptions(mode=mode, bootstrap_port=port or free_port(), host=HOST)
    return make_control(options, ranks, MODEL)


def is_open(c: Control) -> bool:
    """The control's bootstrap sockets are still there."""
    if isinstance(c, PrefillControl):
        return not c.server.sock.closed and not c.ctx.closed
    return not c.ctx.closed


def kv_params(port: int, room: int) -> SamplingParams:
    return SamplingParams(max_tokens=4, kv_transfer=KVTransferParams(HOST, port, room))


def test_check_switch_refuses_colocated_and_bad_roles():
    with pytest.raises(ValueError, match="serves colocated: only one started with"):
        check_switch("null", "prefill")
    with pytest.raises(ValueError, match="'prefill' or 'decode', got 'null'"):
        check_switch("decode", "null")
    check_switch("decode", "decode")  # no change: allowed
    check_switch("prefill", "decode")


def test_a_bad_mode_is_refused_and_the_control_keeps_serving(ranks):
    c = control(ranks, "decode")
    try:
        for bad in ("null", "both", ""):
            with pytest.raises(ValueError, match="'prefill' or 'decode'"):
                switch_control(c, bad, MODEL)
        assert is_open(c)
    finally:
        c.close()


def test_the_same_mode_returns_the_same_control(ranks):
    for mode in ("prefill", "decode"):
        c = control(ranks, mode)
        try:
            assert switch_control(c, mode, MODEL) is c
            assert is_open(c)
        finally:
            c.close()


def test_pending_transfers_refuse_the_switch_and_the_control_still_serves(ranks):
    c = control(ranks, "prefill")
    port = c.options.bootstrap_port
    try:
        c.on_add("a", kv_params(port, 1), PROMPT)
        assert c.has_pending()
        with pytest.raises(NotDrainedError, match="in flight"):
            switch_control(c, "decode", MODEL)
        # still the prefill control, its bootstrap socket bound: it takes another room
        assert is_open(c) and c.info()["disaggregation_bootstrap_port"] == port
        c.on_add("b", kv_params(port, 2), PROMPT)
        with pytest.raises(ValueError, match="already in use"):
            c.on_add("c", kv_params(port, 2), PROMPT)
        # drained (both aborted, then a poll drops them): now it switches
        c.on_abort("a")
        c.on_abort("b")
        c.poll([{}])
        assert not c.has_pending()
        new = switch_control(c, "decode", MODEL)
        assert isinstance(new, DecodeControl) and new.ranks == c.ranks
        new.close()
    finally:
        if is_open(c):
            c.close()


def test_a_taken_bootstrap_port_fails_and_leaves_the_old_control_serving(ranks):
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        c = control(ranks, "decode", port)
        try:
            with pytest.raises(ValueError, match=f"{port} cannot be bound"):
                switch_control(c, "prefill", MODEL)
            assert is_open(c) and c.role == "decode"
            c.on_add("x", kv_params(free_port(), 5), PROMPT)  # still takes requests
            assert c.poll([{}]) == {}  # nothing parked yet: nothing to ask
            c.on_abort("x")
            assert not c.has_pending()
        finally:
            c.close()


def test_counters_carry_over_and_the_old_control_is_closed(ranks):
    c = control(ranks, "decode")
    c.stats.observe(0.02, 4096, 16)
    before = c.stats.to_json()
    prefill = switch_control(c, "prefill", MODEL)
    try:
        assert isinstance(prefill, PrefillControl) and not is_open(c)
        assert prefill.stats.to_json() == before
        assert prefill.info()["disaggregation_mode"] == "prefill"
        prefill.stats.observe(0.5, 100, 2)
        port = prefill.options.bootstrap_port
        back = switch_control(prefill, "decode", MODEL)
    except BaseException:
        prefill.close()
        raise
    try:
        assert not is_open(prefill) and is_open(back)
        assert back.stats.transfers == 2 and back.stats.bytes == 4196
        # the old prefill control let go of its bootstrap port: a new one can bind it
        again = make_control(
            dataclasses.replace(back.options, mode="prefill", bootstrap_port=port),
            back.ranks,
            MODEL,
        )
        again.close()
    finally:
        back.close()
