"""Real programs from Debian's packages for the tests that start them (Slurm's daemons,
Prometheus): installed with apt-get when missing and the tests run as root; otherwise the
test is skipped with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

INSTALL_TIMEOUT_S = 600


def ensure_installed(packages: tuple[str, ...], binaries: tuple[str, ...]) -> None:
    """Make ``binaries`` available by installing ``packages``; pytest.skip when that can't
    be done (not root, no apt-get, the install failed)."""
    if all(shutil.which(b) for b in binaries):
        return
    names = " and ".join(packages)
    if os.geteuid() != 0:
        pytest.skip(f"{names} not installed, and installing them needs root")
    if shutil.which("apt-get") is None:
        pytest.skip(f"{names} not installed and there is no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    out = None
    for cmd in (install, ["apt-get", "update", "-q"], install):
        try:
            out = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            pytest.skip(f"{' '.join(cmd)} did not finish in {INSTALL_TIMEOUT_S}s")
        if cmd is install and out.returncode == 0:
            break
    missing = [b for b in binaries if shutil.which(b) is None]
    if missing:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-10:]) if out else ""
        pytest.skip(f"installing {names} failed (missing {missing}):\n{tail}")
