"""Build and load the C kernels of ``moeserve/ops/cpu``: each ``*.c`` source is compiled once
per source version and flags with the system C compiler into ``$MOESERVE_CACHE/kernels`` and
loaded with ctypes (no torch headers, so a build takes about a second).

The flags follow the machine (:func:`compile_flags`): on x86-64 AVX2 and FMA, the baseline of
every kernel (wider paths are picked at run time inside them); on aarch64 ``-march`` from what
the CPU reports (:func:`arm_march`), and with SVE the vector length Linux gives new processes
(``-msve-vector-bits``: the kernels' SVE bodies use fixed-length vectors, so a build runs at
that length only; without it they build NEON's). On aarch64 only the sources of
:data:`ARM_SOURCES` build so far; the rest have x86 bodies only (issue 27 adds their NEON/SVE
ones).

Loaded after torch, a library's OpenMP calls bind to the ``libgomp.so.1`` torch already
loaded, so it shares torch's thread pool and ``torch.set_num_threads``. :func:`load` returns
None, and callers use their pure-torch references, on a CPU without the baseline (x86-64
without AVX2/FMA, aarch64 without NEON, any other architecture), for a source without a body
for this architecture, when no compiler is found or the build fails, or with
``MOESERVE_CPU_KERNELS=0``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from moeserve.platform import cpu_flags, default_cache_dir, sve_vector_bits

logger = logging.getLogger(__name__)

ARM_MACHINES = ("aarch64", "arm64")  # platform.machine() on Linux and on macOS
# sources in portable C (no intrinsics), which build for aarch64 as they are
PORTABLE = frozenset({"bitmask.c", "moe_sort.c", "rope.c"})
# the sources with an aarch64 body: the portable ones, and those with NEON/SVE inner loops
ARM_SOURCES = PORTABLE | {"attention.c", "fp32.c", "int8.c"}
# libraries a source links besides libm: the call chain makes its calls through libffi (the
# library ctypes itself uses; its headers come with the Debian package libffi-dev); it has no
# aarch64 build yet (the cross compiler here has no aarch64 libffi), and there the calls go
# one by one from Python
LIBRARIES = {"chain.c": ("-lffi",)}
# aarch64 Features -> GCC -march extension, in the order GCC expects them
_ARM_EXTENSIONS = (("asimddp", "dotprod"), ("i8mm", "i8mm"), ("bf16", "bf16"), ("sve", "sve"))


def arm_march(features: frozenset[str]) -> str:
    """GCC's ``-march`` for an aarch64 CPU from its /proc/cpuinfo ``Features``: Armv8-A
    with NEON, the baseline, plus the int8 dot-product (SDOT), int8 matrix (SMMLA), bf16
    (BFMMLA) and SVE extensions the CPU reports (they need Armv8.2-A)."""
    ext = [name for feature, name in _ARM_EXTENSIONS if feature in features]
    return "-march=" + "+".join(["armv8.2-a" if ext else "armv8-a", *ext])


def compile_flags(
    machine: str, features: frozenset[str], sve_bits: int | None = None
) -> tuple[str, ...] | None:
    """The compiler flags of the kernels on a ``machine`` (``platform.machine()``) whose CPU
    reports ``features`` (and, with SVE, runs vectors of ``sve_bits``; None: unknown, the
    NEON bodies build); None where they do not run (see the module's doc)."""
    if machine in ("x86_64", "AMD64"):
        if not {"avx2", "fma"} <= features:
            return None
        return ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
    if machine in ARM_MACHINES:
        if "asimd" not in features:
            return None
        vl = (f"-msve-vector-bits={sve_bits}",) if sve_bits and "sve" in features else ()
        return ("-O3", arm_march(features), *vl, "-fopenmp", "-shared", "-fPIC")
    return None


def _compile(source: Path, out: Path, flags: tuple[str, ...]) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, str(source), "-o", tmp, "-lm", *LIBRARIES.get(source.name, ())]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)  # atomic: concurrent builders agree on one file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load(source: Path) -> ctypes.CDLL | None:
    """The compiled library of ``source`` (a ``.c`` file), or None when kernels are off or
    cannot be built here (logged once as a warning)."""
    if os.environ.get("MOESERVE_CPU_KERNELS", "1") == "0":
        return None
    machine = platform.machine()
    flags = compile_flags(machine, cpu_flags(), sve_vector_bits())
    if flags is None:
        return None
    if machine in ARM_MACHINES and source.name not in ARM_SOURCES:
        logger.debug("%s has no aarch64 body yet: the torch reference runs", source.name)
        return None
    # the headers beside the source are part of it (common.h)
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:12]
    path = Path(default_cache_dir()) / "kernels" / f"{source.stem}-{digest}.so"
    try:
        if not path.is_file():
            _compile(source, path, flags)
        return ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning(
            "CPU kernels of %s unavailable, using the torch references: %s", source.name, detail
        )
        return None


def declare(lib: ctypes.CDLL, name: str, *argtypes) -> None:
    """Set the argument types of ``lib.name`` (returning void)."""
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = list(argtypes)


I64, F32, INT, PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
