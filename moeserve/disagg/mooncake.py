"""The Mooncake Transfer Engine: this process's end of every KV transfer.

One ``TransferEngine`` per process that owns a KV pool, started in peer-to-peer mode (no
metadata server: a peer is named by ``host:rpc_port``, its "session id", and the engines
exchange their segment descriptors on first contact), over TCP by default or RDMA when a
device is named. The pool's layer tensors are registered once, at start; a prefill instance
then writes a request's KV straight from its blocks into the decode instance's registered
blocks in one batch (:meth:`MooncakeTransport.submit`), and polls it (:meth:`status`)
between engine steps, so no step waits on the network.

Each write of a batch is a Mooncake batch of its own (``transfer_submit_write``), and a worker
thread per peer polls them with ``transfer_check_status`` and short sleeps until every one
has landed. The binding offers nothing better for a batch of writes:

- ``transfer_check_status`` answers for the first task of a batch only, so a batch of several
  writes read "completed" while its larger writes were still landing (and a decode instance
  told "done" computed on part of a prompt); for a batch of one write it is exact.
- ``batch_transfer_sync_write`` and ``get_batch_transfer_status`` are exact, but wait by
  spinning on the status without sleeping: a core per sending rank at 100% for the whole
  transfer. On this 2-core host two prefill ranks sending at once starved everything else,
  the decode instance's receiving thread included, so transfers stalled for seconds and
  timed out (a plain process sleeping in a loop on the same host missed its wake-ups for up
  to 29 s).

A write counts as done once the peer has applied it (0.3.13's TCP transport waits for the
peer's acknowledgement frame; RDMA for the completion), so "done" means every byte is in
place.

Mooncake ships as ``mooncake-transfer-engine-non-cuda`` on PyPI; its shared library links
Debian's ``libibverbs1``, ``librdmacm1`` and ``libnuma1`` even for TCP
(``scripts/install_system_deps.sh`` installs them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from moeserve.platform import UNPINNED_CPUS_ENV

logger = logging.getLogger(__name__)

# writes in flight per peer at once: Mooncake's TCP lanes reject writes when their queue is
# full ("TCP lane queue-full rejection") from a few thousand queued at once
MAX_WRITES = 256
PENDING, DONE, FAILED = 0, 1, -1  # a batch's states (:meth:`MooncakeTransport.status`)
# the worker thread's sleep between polls of its writes' states while a batch is in flight:
# from _POLL_MIN_S, doubling to _POLL_MAX_S while nothing lands (adds at most ~2 ms)
_POLL_MIN_S, _POLL_MAX_S = 1e-4, 2e-3
_RESEND_PAUSE_S = 0.05  # before a write that failed is sent again
# batches run one at a time per peer, on a thread of that peer's own (a peer that stops
# answering holds only its own queue); the threads run on the CPUs the process had before it
# was pinned, not on the rank's cores beside its compute

_SYSTEM_LIBS = "libibverbs1 librdmacm1 libnuma1"


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(
            "prefill/decode disaggregation needs the Mooncake Transfer Engine: "
            "pip install mooncake-transfer-engine-non-cuda, and Debian's "
            f"{_SYSTEM_LIBS} (apt-get install {_SYSTEM_LIBS}; scripts/install_system_deps.sh "
            f"does it as root). The import failed with: {e}"
        ) from e
    return TransferEngine


def _cpus_before_pinning() -> set[int] | None:
    text = os.environ.get(UNPINNED_CPUS_ENV)
    if not text or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        return {int(c) for c in text.split(",")}
    except ValueError:
        return None


def _unpin_this_thread() -> None:
    cpus = _cpus_before_pinning()
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:  # a cpuset shrank since: keep the rank's
            pass


@contextlib.contextmanager
def _unpinned() -> Iterator[None]:
    """This thread on the CPUs the process had before it was pinned, for the duration."""
    if _cpus_before_pinning() is None:
        yield
        return
    before = os.sched_getaffinity(0)
    _unpin_this_thread()
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class MooncakeTransport:
    """This process's transfer engine and its registered memory."""

    def __init__(self, host: str, ib_device: str | None = None, timeout_s: float = 30.0) -> None:
        """Start the engine on ``host`` (the address peers reach this process at): TCP, or
        RDMA on ``ib_device`` (e.g. ``mlx5_0``). A batch whose writes have not all landed
        within ``timeout_s`` fails (a write that fails sooner is sent again meanwhile).
        Raises RuntimeError when it cannot start."""
        self.timeout_s = timeout_s
        engine_cls = _import_engine()
        self.engine = engine_cls()
        self.protocol = "rdma" if ib_device else "tcp"
        # the engine's threads start here and inherit this thread's CPUs: not the rank's
        # pinned cores, where its compute threads would delay them
        with _unpinned():
            rc = self.engine.initialize(host, "P2PHANDSHAKE", self.protocol, ib_device or "")
        if rc != 0:
            raise RuntimeError(
                f"the Mooncake transfer engine did not start on {host} over {self.protocol} "
                f"(code {rc})"
            )
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._queues: dict[str, ThreadPoolExecutor] = {}  # peer session -> its thread
        # peer -> writes given up on at a batch's deadline and maybe still on the wire: the
        # engine frees a write's state only once it ended, so the peer's thread asks again
        self._abandoned: dict[str, list[int]] = {}

    def register(self, addrs: Sequence[int], sizes: Sequence[int]) -> None:
        """Register memory the peers may write into or this process writes from (once)."""
        rc = self.engine.batch_register_memory(list(addrs), list(sizes))
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register {len(addrs)} KV buffers (code {rc})")
        self._registered.extend(addrs)

    def submit(
        self, peer: str, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int]
    ) -> Future:
        """Start writing ``lengths[i]`` bytes from local ``srcs[i]`` to ``dsts[i]`` in the
        peer's registered memory; returns the batch to poll with :meth:`status`."""
        queue = self._queues.get(peer)
        if queue is None:
            queue = self._queues[peer] = ThreadPoolExecutor(1, thread_name_prefix="mooncake")
        return queue.submit(self._write, peer, list(srcs), list(dsts), list(lengths))

    def _write(self, peer: str, srcs: list, dsts: list, lengths: list) -> int:
        """Every write as a Mooncake batch of one, at most MAX_WRITES in flight; 0 once all
        landed, -1 when one could not be sent or the deadline passed first."""
        _unpin_this_thread()
        self._forget_ended(peer)
        deadline = time.monotonic() + self.timeout_s
        in_flight: dict[int, int] = {}  # Mooncake batch id -> index of its write
        waiting = list(range(len(srcs)))[::-1]  # to send, the next one last
        pause, refused = _POLL_MIN_S, False
        while waiting or in_flight:
            while waiting and len(in_flight) < MAX_WRITES:
                i = waiting[-1]
                batch = self.engine.transfer_submit_write(peer, srcs[i], dsts[i], lengths[i])
                if not batch:  # the peer's segment could not be opened, or the submit failed
                    if not refused:
                        logger.warning("%s refused a KV write: trying again", peer)
                    refused = True
                    break
                in_flight[batch] = waiting.pop()
            landed = False
            for batch, i in list(in_flight.items()):
                # 1 done, -1 failed (the engine then frees the batch), 0 pending, -2 timed out
                # in the transport (not freed: kept to ask again)
                state = self.engine.transfer_check_status(batch)
                if state == 0:
                    continue
                del in_flight[batch]
                landed = True
                if state == -2:
                    self._abandoned.setdefault(peer, []).append(batch)
                if state < 0:
                    logger.warning(
                        "a KV write to %s failed (code %d): sending it again", peer, state
                    )
                    waiting.append(i)
                    time.sleep(_RESEND_PAUSE_S)
            if time.monotonic() > deadline:
                self._abandoned.setdefault(peer, []).extend(in_flight)
                return -1
            if landed:
                pause = _POLL_MIN_S
            elif waiting and not in_flight:  # nothing could be sent: try again a bit later
                time.sleep(_RESEND_PAUSE_S)
            else:
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        return 0

    def _forget_ended(self, peer: str) -> None:
        """Ask the engine about writes given up on earlier, so it frees those that ended."""
        abandoned = self._abandoned.get(peer)
        if abandoned:
            abandoned[:] = [b for b in abandoned if self.engine.transfer_check_status(b) in (0, -2)]

    def status(self, batch: Future) -> int:
        """PENDING, DONE (every byte acknowledged by the peer) or FAILED."""
        if not batch.done():
            return PENDING
        if batch.cancelled() or batch.exception() is not None:
            return FAILED
        return DONE if batch.result() == 0 else FAILED

    def close(self) -> None:
        for queue in self._queues.values():
            queue.shutdown(wait=False, cancel_futures=True)
        for addr in self._registered:
            self.engine.unregister_memory(addr)
        self._registered.clear()
