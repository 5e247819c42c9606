"""Which network interface gloo should use on a multi-host run, and whether the rendezvous
address can work from this host at all (:func:`check_rendezvous`).

gloo picks its interface from the host name unless ``GLOO_SOCKET_IFNAME`` says otherwise; on
hosts with several interfaces (or in network namespaces) the name may resolve to an address
the peers cannot reach. The interface that holds the address this host uses to reach the
master is the right one.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.launch.spec import LaunchSpec

_SIOCGIFADDR = 0x8915


def source_address(addr: str) -> str | None:
    """This host's IPv4 address on the route to ``addr`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(addr), 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _interface_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) for every interface that has one."""
    found = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                req = struct.pack("256s", name.encode()[:15])
                found.append(
                    (name, socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24]))
                )
            except OSError:
                continue  # no IPv4 address on this interface
    return found


def interface_with_address(ip: str) -> str | None:
    return next((name for name, got in _interface_addresses() if got == ip), None)


def local_addresses() -> list[str]:
    """This host's IPv4 addresses, one per interface that has one."""
    return [ip for _, ip in _interface_addresses()]


def interface_towards(addr: str) -> str | None:
    """The interface to reach ``addr`` from here, or None when it cannot be told."""
    ip = source_address(addr)
    return interface_with_address(ip) if ip else None


def check_rendezvous(spec: LaunchSpec) -> None:
    """Fail fast, naming the flag, on a rendezvous this host cannot use: on the host of world
    rank 0 (which listens there) a master address that is not one of its own or a master port
    already taken; on any other host a master address it has no route to. A route that
    exists but leads nowhere shows as the join timing out (``--dist-timeout``)."""
    addr = spec.master_addr.strip("[]")
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        ip = socket.getaddrinfo(addr, None, family)[0][4][0]
    except socket.gaierror as e:
        raise ValueError(f"--master-addr {addr!r} does not resolve: {e.strerror}") from None
    if spec.rank != 0:
        if family == socket.AF_INET and source_address(ip) is None:
            raise ValueError(
                f"no network interface of this host reaches --master-addr {addr} ({ip}); "
                f"give node 0's address on a network this host is on"
            )
        return
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            mine = ", ".join(local_addresses()) or "none found"
            raise ValueError(
                f"--master-addr {addr} ({ip}) is not an address of this host, which runs "
                f"world rank 0 and listens there for the other ranks (this host has: {mine})"
            ) from None
    if spec.source == "torchrun":
        return  # torchrun's agent already listens on MASTER_PORT and hosts the store
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, spec.master_port))
        except OSError as e:
            raise ValueError(
                f"--master-port {spec.master_port} on {addr} is not free on this host "
                f"({e.strerror}); rank 0 listens there for the other ranks: pick another port"
            ) from None
