"""Build and load the C kernels of ``moeserve/ops/cpu``: each ``*.c`` source is compiled once
per source version with the system C compiler into ``$MOESERVE_CACHE/kernels`` and loaded
with ctypes (no torch headers, so a build takes about a second).

Loaded after torch, a library's OpenMP calls bind to the ``libgomp.so.1`` torch already
loaded, so it shares torch's thread pool and ``torch.set_num_threads``. :func:`load` returns
None, and callers use their pure-torch references, when the CPU lacks AVX2/FMA, no compiler is
found, the build fails, or ``MOESERVE_CPU_KERNELS=0``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from moeserve.platform import cpu_flags, default_cache_dir

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


def _compile(source: Path, out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, str(source), "-o", tmp, "-lm"]
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
    if not {"avx2", "fma"} <= cpu_flags():
        return None
    # the headers beside the source are part of it (common.h)
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:12]
    path = Path(default_cache_dir()) / "kernels" / f"{source.stem}-{digest}.so"
    try:
        if not path.is_file():
            _compile(source, path)
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
