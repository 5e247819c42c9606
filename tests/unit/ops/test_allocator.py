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
