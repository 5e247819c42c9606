"""Which network interface gloo should use on a multi-host run.

gloo picks its interface from the host name unless ``GLOO_SOCKET_IFNAME`` says otherwise; on
hosts with several interfaces (or in network namespaces) the name may resolve to an address
the peers cannot reach. The interface that holds the address this host uses to reach the
master is the right one.
"""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915


def source_address(addr: str) -> str | None:
    """This host's IPv4 address on the route to ``addr`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(addr), 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_with_address(ip: str) -> str | None:
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                continue  # no IPv4 address on this interface
        if got == ip:
            return name
    return None


def interface_towards(addr: str) -> str | None:
    """The interface to reach ``addr`` from here, or None when it cannot be told."""
    ip = source_address(addr)
    return interface_with_address(ip) if ip else None
