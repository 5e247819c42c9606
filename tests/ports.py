"""Ports for the servers a test starts, free now and outside the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket


def _first_ephemeral_port() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(span: int = 1) -> int:
    """A port P on 127.0.0.1 with P .. P + span - 1 free now (the router needs P + 1 for its
    metrics), below the kernel's ephemeral range: a port from there (what binding port 0
    gives) may become the local end of some outgoing connection before the process that is
    told to listen on it binds it. Another process may still take it first: rare."""
    top = max(_first_ephemeral_port(), 12000) - span
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, top)
        socks = [socket.socket() for _ in range(span)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", port + i))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return port
    raise RuntimeError("found no free port on 127.0.0.1")
