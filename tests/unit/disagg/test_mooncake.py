"""``MooncakeTransport`` between two transfer engines of this process, over TCP on loopback."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

pytest.importorskip("mooncake.engine")

from moeserve.disagg.mooncake import DONE, FAILED, PENDING, MooncakeTransport  # noqa: E402


def test_a_transfer_is_done_only_once_every_write_landed():
    """A small write, then a large one: ``transfer_check_status`` of a Mooncake batch answers
    for its first task only, so one batch for both read "done" while the large write was
    still on the wire (and the decode instance then computed on part of its KV)."""
    n = 64 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    sender, receiver = MooncakeTransport("127.0.0.1"), MooncakeTransport("127.0.0.1")
    try:
        sender.register([src.data_ptr()], [n])
        receiver.register([dst.data_ptr()], [n])
        s, d = src.data_ptr(), dst.data_ptr()
        batch = sender.submit(receiver.session_id, [s, s + 1024], [d, d + 1024], [1024, n - 1024])
        deadline = time.monotonic() + 60
        while (status := sender.status(batch)) == PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert status == DONE
        assert torch.equal(src, dst)
    finally:
        sender.close()
        receiver.close()


def _receiver(out, stop) -> None:
    """A peer process with one registered buffer: sends its session id and address."""
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    peer = MooncakeTransport("127.0.0.1")
    peer.register([buf.data_ptr()], [buf.numel()])
    out.put((peer.session_id, buf.data_ptr()))
    stop.wait(120)
    peer.close()


def test_a_transfer_waits_without_spinning_and_fails_at_its_timeout():
    """A peer that stops answering (SIGSTOP) mid-way: the transfer fails at its timeout, and
    waiting for it costs little CPU (``batch_transfer_sync_write`` spun a core at 100% for the
    whole wait, which on a small host starved the peers' receiving threads)."""
    ctx = multiprocessing.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    peer = ctx.Process(target=_receiver, args=(out, stop), daemon=True)
    peer.start()
    src = torch.ones(1 << 20, dtype=torch.uint8)
    sender = MooncakeTransport("127.0.0.1", timeout_s=2.0)
    try:
        session, addr = out.get(timeout=60)
        sender.register([src.data_ptr()], [src.numel()])
        s = src.data_ptr()
        first = sender.submit(session, [s], [addr], [4096])
        assert first.result(timeout=30) == 0 and sender.status(first) == DONE
        os.kill(peer.pid, signal.SIGSTOP)
        cpu, wall = time.process_time(), time.monotonic()
        stalled = sender.submit(
            session,
            [s + i * 65536 for i in range(16)],
            [addr + i * 65536 for i in range(16)],
            [65536] * 16,
        )
        assert stalled.result(timeout=30) != 0 and sender.status(stalled) == FAILED
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        assert 1.5 <= wall < 10
        assert cpu < 0.25 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s of waiting"
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        stop.set()
        peer.join(10)
        if peer.is_alive():
            peer.kill()
        sender.close()
