"""``MooncakeTransport`` between two transfer engines of this process, over TCP on loopback."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("mooncake.engine")

from moeserve.disagg.mooncake import DONE, PENDING, MooncakeTransport  # noqa: E402


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
