"""The Mooncake Transfer Engine: this process's end of every KV transfer.

One ``TransferEngine`` per process that owns a KV pool, started in peer-to-peer mode (no
metadata server: a peer is named by ``host:rpc_port``, its "session id", and the engines
exchange their segment descriptors on first contact), over TCP by default or RDMA when a
device is named. The pool's layer tensors are registered once, at start; a prefill instance
then writes a request's KV straight from its blocks into the decode instance's registered
blocks, one Mooncake batch per contiguous run (:meth:`MooncakeTransport.submit`), and polls
them (:meth:`status`) between engine steps, so no step waits on the network.

Mooncake ships as ``mooncake-transfer-engine-non-cuda`` on PyPI; its shared library links
Debian's ``libibverbs1``, ``librdmacm1`` and ``libnuma1`` even for TCP
(``scripts/install_system_deps.sh`` installs them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PENDING, DONE, FAILED = 0, 1, -1  # what TransferEngine.transfer_check_status answers

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


@dataclass
class TransferBatch:
    """The Mooncake batches of one transfer (one write each) that are not finished yet."""

    pending: list[int] = field(default_factory=list)
    failed: bool = False


class MooncakeTransport:
    """This process's transfer engine and its registered memory."""

    def __init__(self, host: str, ib_device: str | None = None) -> None:
        """Start the engine on ``host`` (the address peers reach this process at): TCP, or
        RDMA on ``ib_device`` (e.g. ``mlx5_0``). Raises RuntimeError when it cannot start."""
        engine_cls = _import_engine()
        self.engine = engine_cls()
        self.protocol = "rdma" if ib_device else "tcp"
        rc = self.engine.initialize(host, "P2PHANDSHAKE", self.protocol, ib_device or "")
        if rc != 0:
            raise RuntimeError(
                f"the Mooncake transfer engine did not start on {host} over {self.protocol} "
                f"(code {rc})"
            )
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, addrs: Sequence[int], sizes: Sequence[int]) -> None:
        """Register memory the peers may write into or this process writes from (once)."""
        rc = self.engine.batch_register_memory(list(addrs), list(sizes))
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register {len(addrs)} KV buffers (code {rc})")
        self._registered.extend(addrs)

    def submit(
        self, peer: str, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int]
    ) -> TransferBatch:
        """Start writing ``lengths[i]`` bytes from local ``srcs[i]`` to ``dsts[i]`` in the
        peer's registered memory; returns what to poll (:meth:`status`). Raises RuntimeError
        when the transfer cannot even start (an unreachable peer).

        One Mooncake batch per write: ``transfer_check_status``, the binding's only status
        call that does not block, answers for the first task of a batch alone (and frees the
        batch once that task is done), so a batch of several writes would read "done" while
        the others are still on the wire."""
        batch = TransferBatch()
        for src, dst, length in zip(srcs, dsts, lengths, strict=True):
            rc = self.engine.batch_transfer_async_write(peer, [src], [dst], [length])
            if rc <= 0:
                if not batch.pending:
                    raise RuntimeError(f"Mooncake could not start a transfer to {peer} (code {rc})")
                batch.failed = True  # FAILED once the writes already started are finished
                break
            batch.pending.append(rc)
        return batch

    def status(self, batch: TransferBatch) -> int:
        """PENDING until every write of ``batch`` finished, then DONE or FAILED."""
        still = []
        for b in batch.pending:
            rc = self.engine.transfer_check_status(b)  # frees ``b`` once done or failed
            if rc == FAILED:
                batch.failed = True
            elif rc != DONE:  # PENDING, or -2 (Mooncake's timeout: the write may still land)
                still.append(b)
        batch.pending = still
        if still:
            return PENDING
        return FAILED if batch.failed else DONE

    def close(self) -> None:
        for addr in self._registered:
            self.engine.unregister_memory(addr)
        self._registered.clear()
