"""Two simulated hosts for tests: network namespaces joined by a veth pair.

``two_hosts()`` yields the namespaces' names (host A holds 10.231.0.1, host B 10.231.0.2) and
deletes them afterwards; it skips the test, with the reason, where namespaces cannot be made
(no root, no ``ip``). ``in_host(ns, cmd)`` is the command line that runs ``cmd`` inside one.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator

import pytest

HOST_A, HOST_B = "10.231.0.1", "10.231.0.2"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


@contextlib.contextmanager
def two_hosts() -> Iterator[list[str]]:
    tag = uuid.uuid4().hex[:6]
    hosts = [f"msa{tag}", f"msb{tag}"]
    try:
        probe = _ip("netns", "add", hosts[0])
    except FileNotFoundError:
        pytest.skip("no 'ip' command here: cannot create network namespaces")
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {probe.stderr.strip()}")
    try:
        steps = [
            ("netns", "add", hosts[1]),
            ("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"),
            ("link", "set", f"va{tag}", "netns", hosts[0]),
            ("link", "set", f"vb{tag}", "netns", hosts[1]),
            ("-n", hosts[0], "addr", "add", f"{HOST_A}/24", "dev", f"va{tag}"),
            ("-n", hosts[1], "addr", "add", f"{HOST_B}/24", "dev", f"vb{tag}"),
        ]
        for ns, dev in zip(hosts, (f"va{tag}", f"vb{tag}")):
            steps += [("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the veth link: ip {' '.join(step)}: {done.stderr}")
        yield hosts
    finally:
        for ns in hosts:
            _ip("netns", "del", ns)  # deletes its end of the veth pair too


def in_host(ns: str, cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]
