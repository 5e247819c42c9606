"""Two revisions' CPU kernels in one engine process, alternating: did a kernel change speed up
the decode step?

`commit_ab.py` runs each commit's whole benchmark in its own process, a few times: on this
shared host two processes an hour apart see memory bandwidth 10-20% apart, more than most
kernel changes are worth. Here one process holds one engine per weight format and swaps the
C kernels under it: the kernel sources (``moeserve/ops/cpu/*.c`` and ``*.h``) of each
revision are compiled into a temporary folder, ``ops/cpu/build.load`` hands out the
revision's library, and every prebound call is bound again (``decode_floor.unbind``). Each
round decodes ``--steps`` steps of each revision in turn (the order swapped every round),
so the drift hits both alike; the table gives each revision's median step and the median
over the rounds of old / new step time.

Only the kernels differ: the Python is this checkout's, so the two revisions' kernels must
take the same arguments (a revision that changed a signature or a flag the Python passes
cannot be compared this way; use commit_ab.py). int4 against kernels older than its
`ZERO8` flag (43e8867): with ``MOESERVE_INT4_ZERO8=0``, both read the zero points.

    python benchmarks/kernel_ab.py --old REV [--new REV] [--formats int8,int4] [--batches 1]
                                   [--rounds 10] [--steps 40] [--threads 2]
                                   [--out bench_out/kernel_ab.json]

``--new`` defaults to the working tree's kernels.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import pkgutil
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_model import BENCH_CONFIG, PROMPT_LEN, bench_model_path  # noqa: E402
from decode_floor import start_requests, unbind  # noqa: E402

import moeserve.ops.cpu as cpu_pkg  # noqa: E402
from moeserve import LLM  # noqa: E402
from moeserve.ops.cpu import build  # noqa: E402

KERNELS = "moeserve/ops/cpu"


def sources(rev: str | None, into: Path) -> Path:
    """The kernel sources of ``rev`` (None: the working tree) copied into ``into``."""
    into.mkdir(parents=True)
    if rev is None:
        for f in (ROOT / KERNELS).iterdir():
            if f.suffix in (".c", ".h"):
                (into / f.name).write_bytes(f.read_bytes())
        return into
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, f"{KERNELS}/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in names:
        if name.endswith((".c", ".h")):
            blob = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:{name}"], check=True, capture_output=True
            ).stdout
            (into / Path(name).name).write_bytes(blob)
    return into


class Kernels:
    """Hands out one revision's compiled kernels through ``build.load`` while it is current."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs
        self.current: str | None = None
        self.libs: dict[tuple[str, str], ctypes.CDLL | None] = {}
        self._load = build.load
        build.load = self.load

    def load(self, source: Path) -> ctypes.CDLL | None:
        if self.current is None:
            return self._load(source)
        path = self.dirs[self.current] / source.name
        if not path.is_file():  # a source the revision does not have: this tree's
            return self._load(source)
        key = (self.current, source.name)
        if key not in self.libs:
            # build.load's own build of that file, from the revision's folder (its headers)
            self.libs[key] = self._load.__wrapped__(path)
        return self.libs[key]

    def use(self, name: str | None, model) -> None:
        """Make ``name``'s kernels current (None: this checkout's): every cached library
        handle dropped, every prebound call bound again on its next use."""
        self.current = name
        for info in pkgutil.iter_modules(cpu_pkg.__path__):
            mod = importlib.import_module(f"moeserve.ops.cpu.{info.name}")
            for attr in ("_library", "_function"):
                fn = getattr(mod, attr, None)
                if hasattr(fn, "cache_clear"):
                    fn.cache_clear()
        unbind(model)


def step_ms(llm: LLM, batch: int, steps: int, tag: str) -> float:
    """Median ms of ``steps`` decode steps of ``batch`` sequences (after their prefill)."""
    engine = llm.engine
    start_requests(llm, batch, steps + 4, BENCH_CONFIG["vocab_size"], tag)
    for _ in range(2):
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[:-1])  # the last step also finishes them


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the revision to compare against")
    ap.add_argument("--new", default=None, help="default: the working tree's kernels")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40, help="decode steps a revision a round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench_out/kernel_ab.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        dirs = {
            "old": sources(args.old, Path(tmp) / "old"),
            "new": sources(args.new, Path(tmp) / "new"),
        }
        kernels = Kernels(dirs)
        for fmt in args.formats.split(","):
            llm = LLM(
                model=str(bench_model_path()),
                dtype="float32",
                **({} if fmt == "fp32" else {"quantization": fmt}),
                max_num_seqs=max(batches),
                max_model_len=PROMPT_LEN + args.steps + 16,
                num_threads=args.threads,
                progress=False,
            )
            model = llm.engine.runner.model
            for b in batches:
                got: dict[str, list[float]] = {"old": [], "new": []}
                for r in range(args.rounds):
                    for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                        kernels.use(name, model)
                        got[name].append(step_ms(llm, b, args.steps, f"{fmt}-{b}-{r}-{name}"))
                ratios = [o / n for o, n in zip(got["old"], got["new"])]
                rows.append(
                    dict(
                        format=fmt,
                        batch=b,
                        old_ms=statistics.median(got["old"]),
                        new_ms=statistics.median(got["new"]),
                        speedup=statistics.median(ratios),
                        rounds=ratios,
                    )
                )
            kernels.use(None, model)
            del llm
    print(
        f"kernels of {args.old} (old) against {args.new or 'the working tree'} (new), "
        f"{args.rounds} rounds alternating, {args.threads} threads, {platform.machine()}"
    )
    print(
        "| format | batch | old ms | new ms | old / new | rounds |\n|---|---:|---:|---:|---:|---|"
    )
    for r in rows:
        cells = (r["format"], r["batch"], f"{r['old_ms']:.3f}", f"{r['new_ms']:.3f}")
        per = " ".join(f"{x:.2f}" for x in r["rounds"])
        print("| " + " | ".join(map(str, cells)) + f" | {r['speedup']:.3f}x | {per} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(vars(args), machine=platform.machine(), processor=platform.processor())
    out.write_text(json.dumps(dict(run=record, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
