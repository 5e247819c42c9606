"""``serving/supervisor``: a child that ignores our stop signal is killed after the wait, or
at once at a second signal; every path reaps it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from moeserve.serving.supervisor import StopFlag, StopSignals, spawn, supervise, terminate

# a child that ignores SIGTERM and SIGINT and says so on stdout once it does (one that died
# of the forwarded SIGINT before the SIGKILL, on a busy host, would exit 1 instead)
_STUBBORN = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)",
]


def _stubborn() -> subprocess.Popen:
    child = subprocess.Popen(_STUBBORN, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_child_that_ignores_the_signal_is_killed_after_the_wait():
    child = _stubborn()
    stop = StopFlag()
    stop.signum, stop.count = signal.SIGTERM, 1
    t0 = time.monotonic()
    assert supervise(child, stop, stop_wait_s=0.5) == 128 + signal.SIGKILL
    assert 0.5 <= time.monotonic() - t0 < 5
    assert child.returncode == -signal.SIGKILL  # reaped


def test_a_second_signal_kills_at_once():
    child = _stubborn()
    stop = StopFlag()
    stop.signum, stop.count = signal.SIGINT, 2
    t0 = time.monotonic()
    assert supervise(child, stop, stop_wait_s=60) == 128 + signal.SIGKILL
    assert time.monotonic() - t0 < 5


def test_a_child_that_exits_gives_its_code_and_terminate_reaps():
    child = spawn([sys.executable, "-c", "raise SystemExit(3)"])
    assert supervise(child, StopFlag(), stop_wait_s=1) == 3
    stubborn = _stubborn()
    terminate(stubborn, stop_wait_s=0.3)
    assert stubborn.returncode == -signal.SIGKILL
    assert not StopFlag().sleep(0.05)


def test_a_signal_delivered_twice_at_once_is_one_stop_and_a_later_one_forces(monkeypatch):
    """scancel signals every process of a Slurm batch step and the batch script passes the
    SIGTERM on as well: the router got it twice in a few ms and SIGKILLed sglang-router (exit
    137) instead of letting it drain. A second signal a second or more later still forces."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    stop = StopFlag()
    with StopSignals(stop) as flag:
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGTERM, None)
        now[0] += 0.01
        handler(signal.SIGTERM, None)
        assert (flag.signum, flag.count) == (signal.SIGTERM, 1)
        now[0] += 1.5
        handler(signal.SIGINT, None)
        assert (flag.signum, flag.count) == (signal.SIGTERM, 2)
