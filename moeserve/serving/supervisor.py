"""One child process under our SIGTERM/SIGINT: forward the signal, wait a bounded time, then
SIGKILL; never leave it a zombie or an orphan. Standard library only (``moeserve router``
starts fast)."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

from moeserve.libc import die_with_parent

logger = logging.getLogger("moeserve.supervisor")

_POLL_S = 0.25  # between two checks of the child and of the stop flag
# a repeat within this long of the first stop signal is the same stop delivered twice (Slurm's
# scancel signals every process of a batch step, and the batch script passes it on too), not a
# second request that forces the exit
_REPEAT_S = 1.0


class StopFlag:
    """Set by :class:`StopSignals`' handlers and polled by every wait (plain attributes, no
    lock: a handler runs between two bytecodes of the main thread, which may hold one)."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first stop signal
        self.first_at: float | None = None  # when it came
        self.count = 0  # a second one (_REPEAT_S or more later) forces the exit

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; returns whether a stop was asked for."""
        end = time.monotonic() + seconds
        while self.signum is None and time.monotonic() < end:
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        return self.signum is not None


class StopSignals:
    """While inside, SIGTERM and SIGINT set ``stop`` instead of ending the process; the
    previous handlers come back at exit. Only the main thread can install handlers, so in
    another thread it changes nothing."""

    def __init__(self, stop: StopFlag) -> None:
        self.stop = stop
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handler)
        return self.stop

    def _handler(self, signum, frame) -> None:
        now = time.monotonic()
        if self.stop.signum is None:
            self.stop.signum, self.stop.first_at = signum, now
        elif now - self.stop.first_at < _REPEAT_S:
            return  # the same stop delivered twice
        self.stop.count += 1

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def spawn(argv: Sequence[str]) -> subprocess.Popen:
    """Start ``argv`` in our process group (a Ctrl-C in the terminal reaches it too); the
    kernel sends it SIGTERM if this process dies without stopping it (SIGKILL, a crash)."""
    return subprocess.Popen(list(argv), preexec_fn=lambda: die_with_parent(signal.SIGTERM))


def supervise(child: subprocess.Popen, stop: StopFlag, stop_wait_s: float) -> int:
    """Wait for ``child``. Once ``stop`` is set, forward its signal, and SIGKILL the child if
    it still runs ``stop_wait_s`` later or at a second signal. Returns the child's exit code,
    128 + N if signal N ended it."""
    forwarded_at: float | None = None
    while True:
        try:
            return _exit_code(child.wait(timeout=_POLL_S))
        except subprocess.TimeoutExpired:
            pass
        if stop.signum is not None and forwarded_at is None:
            logger.info("stopping pid %d (%s)", child.pid, signal.Signals(stop.signum).name)
            child.send_signal(stop.signum)
            forwarded_at = time.monotonic()
        if forwarded_at is None:
            continue
        if stop.count > 1 or time.monotonic() - forwarded_at > stop_wait_s:
            why = "a second signal" if stop.count > 1 else f"still running after {stop_wait_s:g} s"
            logger.warning("pid %d: %s: SIGKILL", child.pid, why)
            child.kill()
            return _exit_code(child.wait())


def terminate(child: subprocess.Popen, stop_wait_s: float) -> None:
    """SIGTERM ``child`` if it runs, wait up to ``stop_wait_s``, then SIGKILL; reaps it."""
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=stop_wait_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode
