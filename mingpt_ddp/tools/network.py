"""Which of this machine's addresses and network interfaces reach the rendezvous host.

    python -m mingpt_ddp.network HEAD_NODE      # prints: local=1 addr=10.77.91.1 iface=eth1

launch/multinode.sh asks this before starting torchrun, and mingpt-torchrun asks whether
the rendezvous endpoint is one of this machine's addresses. Neither torchrun nor gloo asks
the network: torchrun hosts the rendezvous only where the endpoint matches what the host
*name* resolves to, and gloo (NCCL's fallback too) binds the address the host name resolves
to, else loopback. On a machine with several interfaces (EFA nodes, a VPN, containers)
the host name resolves to another interface than the one that reaches the other nodes:
then nobody hosts the rendezvous, or the workers advertise an address the others cannot
reach. Here the answer comes from the routing table instead: the address this machine
sends from to reach HEAD_NODE, and the interface that holds it.

Standard library only (no torch import): it runs in a shell script's critical path.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import socket
import sys
from typing import Optional

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.tools import usage


def resolve(host: str) -> list[str]:
    """`host`'s addresses, IPv4 first; [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    addrs = []
    for family, *_, sockaddr in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        if sockaddr[0] not in addrs:
            addrs.append(sockaddr[0])
    return addrs


def is_local(host: str) -> bool:
    """Whether `host` is this machine: its host name, or an address one can bind here (only
    an address of one of this machine's interfaces can be bound)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    for addr in resolve(host):
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            try:
                s.bind((addr, 0))
                return True
            except OSError:
                pass
    return False


def source_address(host: str) -> Optional[str]:
    """The address this machine sends from to reach `host` (its own address when `host` is
    local). A connected UDP socket asks the routing table; no packet is sent."""
    for addr in resolve(host):
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((addr, 9))
            except OSError:
                continue  # no route
            return s.getsockname()[0]
    return None


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.POINTER(_SockAddr)), ("netmask", ctypes.POINTER(_SockAddr)),
                     ("ifu", ctypes.POINTER(_SockAddr)), ("data", ctypes.c_void_p)]


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, address) for every IPv4/IPv6 address of this machine (getifaddrs(3));
    [] where libc has no getifaddrs."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if not hasattr(libc, "getifaddrs"):
        return []
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    found = []
    try:
        entry = head
        while entry:
            ifa = entry.contents
            if ifa.addr:
                family, raw = ifa.addr.contents.family, bytes(ifa.addr.contents.data)
                if family == socket.AF_INET:  # sockaddr_in: port (2 bytes), then the address
                    found.append((ifa.name.decode(), socket.inet_ntop(socket.AF_INET, raw[2:6])))
                elif family == socket.AF_INET6:  # sockaddr_in6: port, flowinfo (4), address
                    found.append((ifa.name.decode(), socket.inet_ntop(socket.AF_INET6, raw[6:22])))
            entry = ifa.next
    finally:
        libc.freeifaddrs(head)
    return found


def interface_of(address: str) -> Optional[str]:
    """The interface that holds `address`."""
    for name, addr in interface_addresses():
        if addr == address.split("%")[0]:
            return name
    return None


def describe(host: str) -> dict[str, str]:
    """local (1/0), addr (this machine's address toward `host`) and iface (the interface
    holding it); addr and iface are empty when `host` does not resolve or has no route."""
    addr = source_address(host) or ""
    return {"local": "1" if is_local(host) else "0", "addr": addr, "iface": (interface_of(addr) or "") if addr else ""}


USAGE = "usage: python -m mingpt_ddp.network HOST"


def main(argv: list[str]) -> int:
    try:
        _, argv = usage.options(argv, __doc__, USAGE)
        if len(argv) != 1:
            raise ConfigError(f"give one host ({USAGE})")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code
    print(" ".join(f"{k}={v}" for k, v in describe(argv[0]).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
