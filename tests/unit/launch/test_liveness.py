"""Heartbeats, rank 0's view of them and the failure/stop notices, on a real TCPStore."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from moeserve.launch import liveness
from moeserve.launch.liveness import (
    LivenessTable,
    RankIdentity,
    RankMonitor,
    connect_store,
    publish_failure,
    request_stop,
)
from moeserve.launch.spec import LaunchSpec, free_port


def _spec(rank: int, port: int, world: int = 3) -> LaunchSpec:
    return LaunchSpec(world, rank, rank, world, 1, 0, "127.0.0.1", port, "spawn")


@pytest.fixture
def store_port():
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    yield port
    del server


def test_a_rank_silent_past_the_bounds_is_missing_then_dead():
    table = LivenessTable([1, 2], now=0.0, dead_after_s=10.0)
    table.who[2] = RankIdentity(2, 1, "hostb", "10.0.0.2", 77)
    for t in range(1, 12):
        table.observe(1, t, now=float(t))  # rank 1 beats every second; rank 2 never does
    assert table.missing(2.9) == []
    assert table.missing(3.0) == [
        "rank 2 (node 1, host hostb 10.0.0.2, pid 77): no heartbeat for 3.0s"
    ]
    assert table.dead(9.9) is None
    dead = table.dead(10.0)
    assert dead.startswith("rank 2 (node 1, host hostb 10.0.0.2, pid 77) sent no heartbeat")
    table.observe(2, 5, now=10.5)  # back: neither missing nor dead
    assert table.missing(11.0) == [] and table.dead(11.0) is None


def test_a_counter_that_stops_moving_counts_as_silent():
    table = LivenessTable([1], now=0.0)
    table.observe(1, 4, now=1.0)
    table.observe(1, 4, now=5.0)  # the same value: no beat
    assert table.silent_for(1, 5.0) == 4.0


def _monitor(port: int, **kw) -> tuple[RankMonitor, dict]:
    seen: dict = {"health": [], "failure": [], "stop": []}
    monitor = RankMonitor(
        _spec(0, port),
        on_health=seen["health"].append,
        on_failure=seen["failure"].append,
        on_stop=seen["stop"].append,
        poll_s=0.05,
        **kw,
    )
    return monitor, seen


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_monitor_names_missing_ranks_and_ends_on_the_first_dead_one(store_port, monkeypatch):
    monkeypatch.setattr(liveness, "MISSING_AFTER_S", 0.3)
    beats = {1: liveness.Heartbeat(_spec(1, store_port), interval_s=0.05)}
    beats[1].start()
    monitor, seen = _monitor(store_port, dead_after_s=1.0)
    monitor.start()
    try:
        _until(lambda: seen["health"])  # rank 2 never beat: missing, named without identity
        assert seen["health"][0] and seen["health"][0][0].startswith("rank 2: no heartbeat")
        _until(lambda: seen["failure"])
        assert seen["failure"][0].startswith("rank 2 sent no heartbeat")
        assert monitor.culprit(0) == seen["failure"][0]
    finally:
        beats[1].stop()
        monitor.stop()


def test_a_host_report_ends_the_group_with_its_words(store_port):
    monitor, seen = _monitor(store_port)
    monitor.start()
    try:
        assert publish_failure(_spec(1, store_port), "rank 2 (node 1) was killed by signal 9")
        assert publish_failure(_spec(2, store_port), "a later report")  # the first one wins
        _until(lambda: seen["failure"])
        assert seen["failure"] == ["rank 2 (node 1) was killed by signal 9"]
    finally:
        monitor.stop()


def test_a_stop_request_reaches_rank_0_once(store_port):
    monitor, seen = _monitor(store_port)
    monitor.start()
    try:
        request_stop(_spec(2, store_port), "node 1 got SIGTERM").join()
        request_stop(_spec(1, store_port), "again").join()
        _until(lambda: seen["stop"])
        time.sleep(0.3)
        assert seen["stop"] == ["node 1 got SIGTERM"] and not seen["failure"]
    finally:
        monitor.stop()


def test_no_store_no_report():
    assert not publish_failure(_spec(1, free_port()), "nobody listens")


_STORE_PROCESS = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("up", flush=True)
time.sleep(120)
"""


def test_a_heartbeat_ends_its_rank_when_rank_0_is_gone(monkeypatch):
    port = free_port()
    rank0 = subprocess.Popen(
        [sys.executable, "-c", _STORE_PROCESS, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank0.stdout.readline().strip() == "up"
        monkeypatch.setattr(liveness, "MISSING_AFTER_S", 0.3)
        why: list[str] = []
        beat = liveness.Heartbeat(_spec(1, port), interval_s=0.05)
        monkeypatch.setattr(beat, "_exit", why.append)
        beat.start()
        assert connect_store(_spec(1, port)).add("moeserve/hb/1", 0) >= 1
        rank0.kill()  # rank 0's process is gone, and its store with it
        rank0.wait()
        _until(lambda: why, timeout=15)
        assert "rank 0 is gone" in why[0]
        beat.stop()
    finally:
        rank0.kill()


def test_a_heartbeat_that_was_stopped_never_ends_its_rank(store_port, monkeypatch):
    exited = threading.Event()
    beat = liveness.Heartbeat(_spec(1, store_port), interval_s=0.05)
    monkeypatch.setattr(beat, "_exit", lambda why: exited.set())
    beat.start()
    beat.stop()
    publish_failure(_spec(2, store_port), "the group failed")
    assert not exited.wait(0.5)


def test_rank_0_runs_no_heartbeat():
    with pytest.raises(ValueError, match="rank 0 runs the RankMonitor"):
        liveness.Heartbeat(_spec(0, 1))


def test_stall_dump_writes_the_stacks_of_a_block_that_runs_too_long(tmp_path):
    """The watchdog writes every thread's stack once the block passes its time, and nothing
    when it ends in time (or has no time)."""
    import time

    from moeserve.launch.liveness import stall_dump

    late, quick = tmp_path / "late.txt", tmp_path / "quick.txt"
    with open(late, "w") as out, stall_dump(0.2, out):
        time.sleep(0.6)  # the block in this test: its frame is in the dump
    text = late.read_text()
    assert "Timeout" in text and "test_stall_dump_writes_the_stacks" in text
    with open(quick, "w") as out:
        with stall_dump(2.0, out):
            pass
        with stall_dump(None, out):
            time.sleep(0.3)
        time.sleep(2.2)  # past the first block's time: its watch was cancelled
    assert quick.read_text() == ""
