"""ops/cpu/build.py: the kernels' compiler flags per machine, from the CPU's reported
features (x86's ``flags``, aarch64's ``Features``), and which sources build where."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from moeserve.ops.cpu import build
from moeserve.platform import parse_cpu_flags

CPU_DIR = Path(build.__file__).parent
# the Features lines of real aarch64 CPUs' /proc/cpuinfo
CORTEX_A72 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid"
KUNPENG_920 = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt "
    "fcma dcpop asimddp asimdfhm"
)
GRAVITON3 = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma "
    "lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg "
    "dcpodp svei8mm svebf16 i8mm bf16 dgh rng"
)


def test_cpuinfo_flags_of_both_architectures():
    x86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 fma amx_tile\n"
    assert parse_cpu_flags(x86) == {"fpu", "avx2", "fma", "amx_tile"}
    arm = f"processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: {KUNPENG_920}\nCPU part\t: 0xd01\n"
    assert "asimddp" in parse_cpu_flags(arm) and "sve" not in parse_cpu_flags(arm)
    assert parse_cpu_flags("processor\t: 0\n") == frozenset()


@pytest.mark.parametrize(
    "features, march",
    [
        (CORTEX_A72, "-march=armv8-a"),
        (KUNPENG_920, "-march=armv8.2-a+dotprod"),
        (GRAVITON3, "-march=armv8.2-a+dotprod+i8mm+bf16+sve"),
    ],
)
def test_arm_march_follows_the_reported_features(features, march):
    assert build.arm_march(frozenset(features.split())) == march


def test_compile_flags_per_machine():
    x86 = build.compile_flags("x86_64", frozenset({"avx2", "fma", "avx512f"}))
    assert x86 is not None and {"-mavx2", "-mfma", "-fopenmp"} <= set(x86)
    assert build.compile_flags("x86_64", frozenset({"sse4_2"})) is None  # no AVX2: torch
    arm = build.compile_flags("aarch64", frozenset(GRAVITON3.split()))
    assert arm is not None and "-march=armv8.2-a+dotprod+i8mm+bf16+sve" in arm
    assert not any(f.startswith("-msve-vector-bits") for f in arm)  # length unknown: NEON
    sve = build.compile_flags("aarch64", frozenset(GRAVITON3.split()), sve_bits=256)
    assert "-msve-vector-bits=256" in sve
    kunpeng = build.compile_flags("aarch64", frozenset(KUNPENG_920.split()), sve_bits=256)
    assert not any(f.startswith("-msve-vector-bits") for f in kunpeng)  # no SVE reported
    assert build.compile_flags("aarch64", frozenset({"fp"})) is None  # no NEON
    assert build.compile_flags("riscv64", frozenset()) is None


def test_on_aarch64_a_source_without_an_arm_body_is_not_built(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset(GRAVITON3.split()))
    monkeypatch.setattr(build, "_compile", lambda *a: pytest.fail("compiled an x86 source"))
    build.load.cache_clear()
    try:
        assert build.load(CPU_DIR / "int4.c") is None
    finally:
        build.load.cache_clear()


def test_portable_sources_have_no_x86_intrinsics():
    for name in build.PORTABLE:
        text = (CPU_DIR / name).read_text()
        assert "immintrin.h" not in text and "_mm" not in text, name


CROSS_CC = shutil.which("aarch64-linux-gnu-gcc")


@pytest.mark.skipif(CROSS_CC is None, reason="no aarch64 cross compiler (gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("features", [CORTEX_A72, KUNPENG_920, GRAVITON3])
@pytest.mark.parametrize("sve_bits", [None, 512])
def test_the_arm_sources_cross_compile_with_each_march(features, sve_bits, tmp_path):
    flags = build.compile_flags("aarch64", frozenset(features.split()), sve_bits)
    for name in sorted(build.ARM_SOURCES):
        out = tmp_path / f"{name}.so"
        cmd = [CROSS_CC, *flags, str(CPU_DIR / name), "-o", str(out), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert out.read_bytes()[:4] == b"\x7fELF" and out.read_bytes()[18] == 183  # EM_AARCH64
