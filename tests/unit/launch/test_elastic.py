"""Elastic EP's membership protocol on a real TCPStore (``launch/elastic.py``), rank 0's
ledger of what callers received (``launch/ledger.py``) and the heartbeat monitor's elastic
mode (a dead rank is reported and forgotten, the group goes on)."""

from __future__ import annotations

import threading
import time

import pytest

from moeserve.core import CompletionOutput, RequestOutput, SamplingParams
from moeserve.launch.elastic import GroupEnded, Membership, dead_key, open_store
from moeserve.launch.ledger import RequestLedger, StepOutbox, Tracked
from moeserve.launch.liveness import LivenessTable, RankMonitor
from moeserve.launch.spec import LaunchSpec, free_port


def _spec(rank: int, port: int, world: int = 4) -> LaunchSpec:
    return LaunchSpec(world, rank, rank, world, 1, 0, "127.0.0.1", port, "spawn")


@pytest.fixture
def ranks():
    """Membership objects of launch ranks 0..3 on one store (rank 0's serves it)."""
    port = free_port()
    out = [Membership(_spec(0, port), open_store(_spec(0, port), 5), "gloo")]
    out += [Membership(_spec(r, port), open_store(_spec(r, port), 5), "gloo") for r in (1, 2, 3)]
    return out


def _follow(m: Membership, results: dict, wait_s: float = 5) -> threading.Thread:
    def run() -> None:
        try:
            results[m.spec.rank] = m.follow(wait_s)
        except GroupEnded as e:
            results[m.spec.rank] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def test_the_survivors_form_the_next_generation_without_the_dead(ranks):
    r0, r1, r2, r3 = ranks
    results: dict = {}
    for m in (r1, r3):
        m.check_in()
    threads = [_follow(m, results) for m in (r1, r3)]
    t0 = time.monotonic()
    assert r0.decide(lambda: {2}, wait_s=5) == (0, 1, 3)
    assert time.monotonic() - t0 < 1  # nobody left to wait for
    for t in threads:
        t.join()
    assert results == {1: (0, 1, 3), 3: (0, 1, 3)}
    assert (r0.generation, r0.index, r3.index) == (1, 0, 2)
    with pytest.raises(GroupEnded, match="went on without this rank"):
        r2.follow(1)  # it came back too late: it must exit


def test_a_rank_that_never_checks_in_is_left_out_after_the_wait(ranks):
    r0, r1, r2, r3 = ranks
    r1.check_in()
    r2.store.set(dead_key(2), "1")  # its host's agent saw it die
    t0 = time.monotonic()
    assert r0.decide(set, wait_s=0.5) == (0, 1)  # rank 3 silent: left out at the deadline
    assert time.monotonic() - t0 >= 0.5


def test_nobody_dead_ends_the_group(ranks):
    r0, r1, r2, r3 = ranks
    results: dict = {}
    for m in (r1, r2, r3):
        m.check_in()
    threads = [_follow(m, results) for m in (r1, r2, r3)]
    assert r0.decide(set, wait_s=5) == ()
    for t in threads:
        t.join()
    assert all(isinstance(v, GroupEnded) and "ended" in str(v) for v in results.values())


def test_a_member_without_a_decision_gives_up(ranks):
    with pytest.raises(GroupEnded, match="no new generation"):
        ranks[1].follow(0.2)


def test_generations_follow_one_another(ranks):
    r0, r1, r2, r3 = ranks
    for m in (r1, r2):
        m.check_in()
    results: dict = {}
    threads = [_follow(m, results) for m in (r1, r2)]
    assert r0.decide(lambda: {3}, 5) == (0, 1, 2)
    for t in threads:
        t.join()
    r1.check_in()  # generation 1 fails too: rank 2 dies
    t = _follow(r1, results)
    assert r0.decide(lambda: {2}, 5) == (0, 1)
    t.join()
    assert results[1] == (0, 1) and r1.generation == r0.generation == 2


def _out(rid, tokens, finished=False, reason=None, index=0, lp=None):
    c = CompletionOutput(index, "", tokens, lp and sum(lp), lp, reason)
    return RequestOutput(rid, None, [1], [c], finished)


def test_ledger_keeps_what_callers_received():
    ledger = RequestLedger(2)
    delta = SamplingParams(n=2, output_kind="delta")
    ledger.add(Tracked("a", None, [1, 2], delta, 0))
    ledger.add(Tracked("b", None, [3], SamplingParams(), 1))
    ledger.add(Tracked("c", None, [4], SamplingParams(output_kind="final"), 1))
    assert ledger.load == [2, 2] and ledger.least_loaded() == 0
    ledger.observe([_out("a", [5]), _out("b", [7, 8])])
    ledger.observe([_out("a", [6]), _out("a", [9], reason="length", index=1)])
    ledger.observe([_out("b", [7, 8, 10])])  # cumulative: replaces
    a, b, c = (ledger.requests[k] for k in "abc")
    assert a.progress[0].token_ids == (5, 6) and a.progress[0].finish_reason is None
    assert a.progress[1].token_ids == (9,) and a.progress[1].finish_reason == "length"
    assert b.progress[0].token_ids == (7, 8, 10)
    assert c.progress[0].token_ids == ()  # "final": resumes from its prompt
    ledger.observe([_out("b", [7, 8, 10, 11], finished=True)])
    assert "b" not in ledger and ledger.load == [2, 1]
    moved = ledger.reassign(3)
    assert [t.request_id for t in moved] == ["a", "c"]  # arrival order
    assert [t.replica for t in moved] == [0, 1] and ledger.load == [2, 1, 0]
    with pytest.raises(ValueError, match="already in use"):
        ledger.add(Tracked("a", None, [1], SamplingParams(), 0))


def test_outbox_sends_each_part_once():
    """An abort of a request not sent yet drops its add; a step takes everything; after a
    recovery the requeued adds replace the pending adds and aborts, and the lost step's
    finishes go first."""
    box = StepOutbox()
    box.adds += [{"id": "a"}, {"id": "b"}]
    box.abort("a")  # not sent yet: never sent
    box.abort("z")  # sent before: its replica is told
    box.finishes.append(("b", 0, None))
    assert box.take() == {"add": [{"id": "b"}], "abort": ["z"], "finish": [("b", 0, None)]}
    assert box.take() == {"add": [], "abort": [], "finish": []}
    box.adds.append({"id": "c"})
    box.aborts.append("d")
    box.finishes.append(("c", 1, "x"))
    box.requeue([{"id": "b", "resumed": True}])
    box.finish_again([("b", 0, None)])
    assert box.take() == {
        "add": [{"id": "b", "resumed": True}],
        "abort": [],
        "finish": [("b", 0, None), ("c", 1, "x")],
    }


def test_monitor_reports_a_dead_rank_once_and_goes_on():
    port = free_port()
    store = open_store(_spec(0, port, 3), 5)
    dead, failures = [], []
    mon = RankMonitor(
        _spec(0, port, 3), on_health=lambda m: None, on_failure=failures.append,
        on_stop=lambda r: None, dead_after_s=0.5, poll_s=0.05,
        on_dead=lambda r, why: dead.append(r),
    ).start()  # fmt: skip
    try:
        deadline = time.monotonic() + 5
        while len(dead) < 2 and time.monotonic() < deadline:
            store.add("moeserve/hb/1", 1)  # rank 1 beats, rank 2 does not
            time.sleep(0.05)
        assert dead == [2] and not failures
        mon.forget([2])
        assert mon.silent_ranks(0.0) == {1}
    finally:
        mon.stop()


def test_liveness_table_forgets():
    table = LivenessTable([1, 2], now=0.0, dead_after_s=1.0)
    assert [r for r, _ in table.dead_ranks(2.0)] == [1, 2]
    table.forget([1])
    assert [r for r, _ in table.dead_ranks(2.0)] == [2] and table.silent(2.0, 1.5) == {2}
