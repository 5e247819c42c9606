"""Compile moeserve's C kernels into ``$MOESERVE_CACHE/kernels`` at image build time, so that
the runtime image needs no C compiler.

moeserve builds each ``moeserve/ops/cpu/*.c`` at first use with the system compiler, into a
file named by a hash of the source, its headers and the flags (``moeserve/ops/cpu/build.py``);
a process that finds the file loads it and compiles nothing. This script goes through that same
path for every source, and exits non-zero naming the sources it could not build. It needs a
build host with AVX2 and FMA (every x86-64 server CPU since 2013; not an emulated or ARM one).
The AMX and AVX-512 kernels compile on any such host: they run only where the CPU has them.

    MOESERVE_CACHE=/opt/moeserve/cache python prebuild_kernels.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch  # noqa: F401  (first, as in moeserve: the kernels bind to torch's libgomp)

import moeserve.ops.cpu
from moeserve.ops.cpu import build
from moeserve.platform import cpu_flags, default_cache_dir


def main() -> int:
    if not {"avx2", "fma"} <= cpu_flags():
        print(
            "error: this build host's CPU lacks AVX2/FMA, so moeserve will not build its "
            "kernels here; build the image on an x86-64 host that has them",
            file=sys.stderr,
        )
        return 1
    sources = sorted(Path(moeserve.ops.cpu.__file__).parent.glob("*.c"))
    if not sources:
        print("error: no kernel sources found in moeserve/ops/cpu", file=sys.stderr)
        return 1
    failed = [s.name for s in sources if build.load(s) is None]
    if failed:
        print(
            f"error: could not build {', '.join(failed)} (see the warnings above)", file=sys.stderr
        )
        return 1
    built = sorted(p.name for p in (Path(default_cache_dir()) / "kernels").glob("*.so"))
    print(f"built {len(sources)} kernels into {default_cache_dir()}/kernels: {' '.join(built)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
