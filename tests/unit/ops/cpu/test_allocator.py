"""The malloc settings an engine applies after loading (ops/cpu/allocator.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CODE = "from moeserve.ops.cpu.allocator import keep_freed_memory as k; print(k(), k())"


def _run(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop("MOESERVE_MALLOC_TUNING", None)
    if env_value is not None:
        env["MOESERVE_MALLOC_TUNING"] = env_value
    done = subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_applies_once_on_glibc_and_can_be_turned_off():
    assert _run(None) == "True True"
    assert _run("0") == "False False"


RELEASE = """
import torch
from moeserve.ops.cpu.allocator import keep_freed_memory, release_freed_memory

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) >> 10  # MiB

keep_freed_memory()  # an earlier engine's setting: freed heap pages stay resident
base = anon()
chunks = [torch.ones(8 << 20) for _ in range(16)]  # 16 x 32 MiB from the heap, touched
del chunks
kept = anon() - base
release_freed_memory()
print(kept, anon() - base)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim only")
def test_release_hands_freed_load_memory_back():
    """What a second engine in one process relies on: after keep_freed_memory, freed heap
    memory stays resident until release_freed_memory (called after loading)."""
    done = subprocess.run(
        [sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    kept, after = (int(v) for v in done.stdout.split())
    assert kept >= 400  # of 512 MiB freed, still resident
    assert after < 64
