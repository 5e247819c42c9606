"""``profile_to(dir)``: a torch.profiler trace of the code inside, written for chrome://tracing
or Perfetto, and a table of the operations that took the most time.

Used by ``moeserve generate --profile DIR`` and ``benchmarks/offline_throughput.py --profile``.
Only the calling process is traced: under a spawned parallel group that is rank 0.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch
from torch.profiler import ProfilerActivity, profile, record_function


@contextlib.contextmanager
def profile_to(
    out_dir: str | Path, top: int = 25, label: str = "moeserve", out: TextIO | None = None
) -> Iterator[None]:
    """Trace the block; write ``trace.json`` and ``top_ops.txt`` into ``out_dir`` and print the
    ``top`` operations by self CPU time (to ``out``, default stderr)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        with record_function(label):
            yield
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top)
    (out_dir / "top_ops.txt").write_text(table + "\n")
    stream = out or sys.stderr
    print(table, file=stream)
    print(f"profile: {trace} (open in chrome://tracing or ui.perfetto.dev)", file=stream)
