"""The ranks this process spawned: one fresh interpreter each, watched until they exit.

A spawned rank that dies is named (rank, exit code, the error it wrote to its error file). On
world rank 0's host the group is then ended (``EngineGroup.fail``); on another host the
agent (``launch/host.py``) reports it to the group and stops.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING

from moeserve.config import EngineConfig
from moeserve.launch.liveness import RankIdentity
from moeserve.launch.numa import RankBinding, describe
from moeserve.launch.spec import LaunchSpec

if TYPE_CHECKING:
    from moeserve.launch.engine_group import EngineGroup

logger = logging.getLogger(__name__)


def worker_command(spec: LaunchSpec, config: EngineConfig, binding: RankBinding) -> list[str]:
    """A fresh interpreter for one rank (nothing of the caller's ``__main__`` is re-run)."""
    payload = {
        "spec": dataclasses.asdict(spec),
        "config": dataclasses.asdict(config),
        "binding": dataclasses.asdict(binding),
    }
    return [sys.executable, "-m", "moeserve.launch.worker", json.dumps(payload)]


class WorkerProcesses:
    """The ranks this process spawned; watches them and ends the group when one dies."""

    def __init__(self, specs: list[LaunchSpec], config: EngineConfig, bindings) -> None:
        self._errdir = tempfile.mkdtemp(prefix="moeserve-ranks-")
        self.procs: dict[int, subprocess.Popen] = {}
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._failure: str | None = None
        self._specs = {spec.rank: spec for spec in specs}
        for spec in specs:
            env = dict(os.environ, MOESERVE_ERROR_FILE=self._error_file(spec.rank))
            self.procs[spec.rank] = subprocess.Popen(
                worker_command(spec, config, bindings[spec.local_rank]), env=env
            )
        if specs:
            logger.info("spawned ranks %s\n%s", sorted(self.procs), describe(bindings))

    def _error_file(self, rank: int) -> str:
        return os.path.join(self._errdir, f"rank{rank}.err")

    def failure(self, wait_s: float = 0.0) -> str | None:
        """What went wrong with the first rank that failed, if one did; waits up to
        ``wait_s`` for one to be seen exiting (a peer's connection may drop before its exit
        status is known)."""
        deadline = time.monotonic() + wait_s
        while self._failure is None and self._scan() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._failure

    def _scan(self) -> str | None:
        if self._failure is None:
            failed = self.failed()
            if failed:
                self._failure = failed[min(failed)]
        return self._failure

    def failed(self) -> dict[int, str]:
        """Every rank that exited with an error, and how (rank, host, code, its error)."""
        out = {}
        for rank, p in sorted(self.procs.items()):
            code = p.poll()
            if code in (None, 0):
                continue
            detail = ""
            try:
                with open(self._error_file(rank)) as f:
                    detail = ": " + f.read().strip()
            except OSError:
                pass
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            who = RankIdentity.of_this_process(self._specs[rank])
            who = dataclasses.replace(who, pid=p.pid).describe()
            out[rank] = f"{who} {how}{detail}"
        return out

    def watch(self, group: EngineGroup, elastic: bool = False) -> None:
        """Watch the ranks from a thread; the first that fails ends ``group`` (``fail``).
        With ``elastic`` every rank that fails is reported (``group.elastic.rank_lost``) and the
        group goes on without it."""

        def loop() -> None:
            reported: set[int] = set()
            while not self._stopping.wait(0.5):
                if elastic:
                    for rank, why in self.failed().items():
                        if rank not in reported and not self._stopping.is_set():
                            reported.add(rank)
                            group.elastic.rank_lost(rank, why)
                    continue
                failure = self.failure()
                if failure is not None and not self._stopping.is_set():
                    group.fail(failure)
                    return

        self._watcher = threading.Thread(target=loop, name="moeserve-rank-watch", daemon=True)
        self._watcher.start()

    def all_exited(self) -> bool:
        return all(p.poll() is not None for p in self.procs.values())

    def _stop_watching(self) -> None:
        """End the watcher and wait for it: a daemon thread still holding the engine when the
        interpreter exits would free its tensors during finalization and abort the process."""
        self._stopping.set()
        w = self._watcher
        if w is not None and w is not threading.current_thread():
            w.join()

    def kill_all(self) -> None:
        self._stop_watching()
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait(timeout=10)
        # every rank has exited: nothing writes an error file any more
        shutil.rmtree(self._errdir, ignore_errors=True)

    def join(self, timeout: float = 30.0) -> None:
        """Wait for the ranks to exit after a stop; kill what is left."""
        self._stop_watching()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill_all()
