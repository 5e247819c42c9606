"""Run a function on N gloo ranks in spawned processes and collect what each returns.

    results = run_ranks(worker, 2, arg)     # worker(rank, world_size, arg) at module level

Each rank joins a fresh gloo group on a free localhost port (the default group; the function
should still pass explicit groups to the code under test). Results travel as plain pickles
(tensors are copied, not shared), so a rank may exit right after returning.
"""

from __future__ import annotations

import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, timeout, threads, fn, args, results) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _next_result(results, timeout: float):
    try:
        return results.get(timeout=timeout)
    except queue.Empty:
        return None


def run_ranks(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = 120.0,
    threads_per_rank: int = 1,
) -> list:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each in its own process.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level). Raises
    AssertionError with the rank's traceback when a rank raises or dies, and TimeoutError when
    the ranks have not all returned within ``timeout`` seconds; every process is gone when this
    returns or raises.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world_size, port, timeout, threads_per_rank, fn, args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            item = _next_result(results, 0.1)
            if item is None:
                missing = sorted(set(range(world_size)) - set(out))
                codes = {r: procs[r].exitcode for r in missing if procs[r].exitcode}
                if codes and results.empty():
                    raise AssertionError(f"ranks died without a result (exit codes): {codes}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {missing} still running after {timeout:.0f} s")
                continue
            rank, ok, payload = item
            if not ok:
                raise AssertionError(f"rank {rank} of {world_size} raised:\n{payload}")
            out[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results.close()
        results.join_thread()
    return [out[r] for r in range(world_size)]
