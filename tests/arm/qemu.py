"""Kernels of ``moeserve/ops/cpu`` built for aarch64 and run under qemu's user-mode emulation
on this x86 machine, so their ARM bodies are tested against the same torch references as
the x86 ones.

Each kernel has a small C driver here (``<kernel>_driver.c``) that reads its inputs from
stdin and writes its outputs to stdout as typed arrays (``blob.h``). The driver and the
kernel's source are linked statically with the cross compiler, using the flags
``ops/cpu/build.compile_flags`` gives an aarch64 CPU of the chosen features, and run with
``qemu-aarch64 -cpu CPU``. Why C drivers and not a Python under emulation: Debian's arm64
Python and numpy would need multiarch packages beside the host's, and a static binary needs
nothing but the cross toolchain and qemu.

CPUS: ``neon`` (a Cortex-A72: NEON only), ``sve256`` and ``sve512`` (qemu's ``max`` CPU with
SVE vectors of 2 and 4 quadwords, ``sve-max-vq``; it also has the dot-product, int8-matrix
and bf16 extensions, so the kernels' SDOT, SMMLA and BFMMLA/BFDOT forms run there) and
``a64fx`` (an A64FX: 512-bit SVE without those extensions, so the SVE bodies run where the
others would take over). A kernel's SVE body is built for the CPU's vector length, as on a
real host (``build.compile_flags``).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np

from moeserve.ops.cpu import build

HERE = Path(__file__).parent
KERNELS = Path(build.__file__).parent
CROSS_CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
MISSING = (
    None
    if CROSS_CC and QEMU
    else "needs gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user-static: "
    "scripts/install_test_deps.sh installs them as root (make test runs it)"
)
# qemu -cpu, the /proc/cpuinfo features such a CPU reports (what build.arm_march reads) and
# its SVE vector length in bits (what build.compile_flags fixes the SVE bodies to)
CPUS = {
    "neon": ("cortex-a72", "fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid", None),
    "sve256": ("max,sve-max-vq=2", "fp asimd asimddp i8mm bf16 sve", 256),
    "sve512": ("max,sve-max-vq=4", "fp asimd asimddp i8mm bf16 sve", 512),
    "a64fx": (
        "a64fx",
        "fp asimd evtstrm sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm fcma dcpop sve",
        512,
    ),
}
_TYPES = {np.dtype(t): code for code, t in enumerate((np.float32, np.int64, np.uint16, np.int32))}
_DTYPES = {code: dtype for dtype, code in _TYPES.items()}


def build_driver(kernel: str, cpu: str, out_dir: Path) -> Path:
    """The static aarch64 binary of ``<kernel>_driver.c`` with ``ops/cpu/<kernel>.c``,
    compiled for ``cpu``'s features."""
    _, features, sve_bits = CPUS[cpu]
    flags = build.compile_flags("aarch64", frozenset(features.split()), sve_bits)
    assert flags is not None
    flags = tuple(f for f in flags if f not in ("-shared", "-fPIC"))
    out = out_dir / f"{kernel}-{cpu}"
    cmd = [CROSS_CC, *flags, "-static", f"-I{HERE}", str(HERE / f"{kernel}_driver.c")]
    cmd += [str(KERNELS / f"{kernel}.c"), "-o", str(out), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}:\n{done.stderr}")
    return out


def run(binary: Path, cpu: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Run ``binary`` under qemu as ``cpu`` with ``arrays`` (float32, int64, uint16 or int32)
    on stdin; return the arrays it wrote."""
    blob = b"".join(
        struct.pack("<iq", _TYPES[a.dtype], a.size) + np.ascontiguousarray(a).tobytes()
        for a in arrays
    )
    done = subprocess.run(
        [QEMU, "-cpu", CPUS[cpu][0], str(binary)], input=blob, capture_output=True, timeout=120
    )
    if done.returncode:
        raise RuntimeError(f"{binary.name} under qemu: {done.stderr.decode()}")
    out, view, at = [], memoryview(done.stdout), 0
    while at < len(view):
        code, n = struct.unpack_from("<iq", view, at)
        dtype = _DTYPES[code]
        at += 12
        out.append(np.frombuffer(view[at : at + n * dtype.itemsize], dtype=dtype).copy())
        at += n * dtype.itemsize
    return out


def has(cpu: str, feature: str) -> bool:
    """Whether ``cpu`` reports ``feature`` (a /proc/cpuinfo ``Features`` word)."""
    return feature in CPUS[cpu][1].split()


def dims(*values: int) -> np.ndarray:
    """Sizes (and a driver's kernel choice) as the int64 array the drivers read first."""
    return np.array(values, dtype=np.int64)


def driver_fixture(kernel: str):
    """A module-scoped pytest fixture giving ``(cpu, binary)`` of ``kernel``'s driver built
    for each of :data:`CPUS` in turn."""
    import pytest

    @pytest.fixture(scope="module", params=sorted(CPUS))
    def driver(request, tmp_path_factory):
        cpu = request.param
        return cpu, build_driver(kernel, cpu, tmp_path_factory.mktemp("arm"))

    return driver


def span(t):
    """A 1-D view of the memory ``t`` (a torch tensor, any strides) spans, from its first
    element to its last: what a kernel given its data pointer and strides reads or writes."""
    import torch

    n = (
        1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        if t.numel()
        else 0
    )
    return torch.as_strided(t, (n,), (1,), t.storage_offset())
