"""Two "hosts" on this machine: Linux network namespaces joined by one veth link.

Each host has its own network stack (addresses, routes, loopback) and shares the filesystem
and host name with the machine, as two servers on one switch with a shared filesystem.
The link can be shaped (tc tbf for the rate; netem's delay where the kernel has it). Names
carry this process's id, so that concurrent test runs never meet, and everything is
removed on exit, also on failure; namespaces left by a killed run (its pid gone) are
removed by the next one. Traffic stays inside the namespaces: the addresses are a private
range that exists only on the veth pair.

Needs root (CAP_SYS_ADMIN / CAP_NET_ADMIN) and iproute2: `Network.unavailable()` says why not.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Optional

SUBNET = "10.77.91"  # /24, only on the veth pair inside the namespaces
_PREFIX = "mgt"
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass
class Host:
    ns: str
    dev: str
    addr: str
    core: Optional[int] = None

    def cmd(self, *argv: str) -> list[str]:
        """`argv` run on this host: in its namespace, on its own core where it has one (a
        host is one core: the trainer, reading its affinity, runs one thread, and two hosts'
        threads do not fight over the same cores)."""
        pin = ["taskset", "-c", str(self.core)] if self.core is not None else []
        return ["ip", "netns", "exec", self.ns, *pin, *argv]

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.ns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]


class Network:
    """Hosts h[0], h[1] at SUBNET.1 and SUBNET.2, joined by one veth link; a context manager."""

    def __init__(self, rate_mbit: Optional[float] = None, delay_ms: Optional[float] = None):
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms
        tag = f"{os.getpid()}x{next(_counter)}"  # interface names: 15 characters at most
        cores = os.cpu_count() or 1
        pin = shutil.which("taskset") is not None and cores >= 2
        self.hosts = [Host(f"{_PREFIX}-{tag}-{i}", f"m{tag}{'ab'[i]}", f"{SUBNET}.{i + 1}", i % cores if pin else None)
                      for i in range(2)]
        self.shaping = "none"

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why namespaces cannot be made here, or None."""
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            return "network namespaces need root (CI runs as root)"
        for tool in ("ip", "tc"):
            if not shutil.which(tool):
                return f"`{tool}` (iproute2) is not installed"
        probe = f"{_PREFIX}-{os.getpid()}-probe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def __enter__(self) -> "Network":
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        a, b = self.hosts
        for h in self.hosts:
            _ip("netns", "add", h.ns)
        _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for h in self.hosts:
            _ip("link", "set", h.dev, "netns", h.ns)
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.dev)
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("-n", h.ns, "link", "set", h.dev, "up")
        if self.rate_mbit or self.delay_ms:
            self.shaping = "; ".join(self._shape(h) for h in self.hosts)

    def _shape(self, h: Host) -> str:
        """Shape `h`'s sending side: netem's delay (where the kernel has it) with tbf's rate
        below it, else tbf alone. Returns what was applied."""
        tc = ["ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", h.dev]
        rate = [] if not self.rate_mbit else [
            "tbf", "rate", f"{self.rate_mbit}mbit", "burst", "32kb", "latency", "50ms"]
        if self.delay_ms:
            netem = subprocess.run([*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms"],
                                   capture_output=True, text=True)
            if netem.returncode == 0:
                if rate:
                    subprocess.run([*tc, "parent", "1:1", "handle", "10:", *rate], check=True, capture_output=True)
                return f"{h.dev}: netem delay {self.delay_ms}ms" + (f" + tbf {self.rate_mbit} Mbit/s" if rate else "")
        if rate:
            subprocess.run([*tc, "root", *rate], check=True, capture_output=True, text=True)
            return f"{h.dev}: tbf {self.rate_mbit} Mbit/s" + (" (no netem in this kernel)" if self.delay_ms else "")
        return f"{h.dev}: none (no netem in this kernel)"

    def link(self, up: bool) -> None:
        """Take the link down (a cable pulled, a switch port dead) or back up."""
        for h in self.hosts:
            _ip("-n", h.ns, "link", "set", h.dev, "up" if up else "down")

    def kill(self, host: Host) -> list[int]:
        """SIGKILL every process on `host` (all started by the test): the machine dies."""
        pids = host.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def close(self) -> None:
        for h in self.hosts:
            if os.path.exists(f"/run/netns/{h.ns}"):
                self.kill(h)
                for _ in range(50):  # a namespace with processes in it outlives `ip netns del`
                    if not h.pids():
                        break
                    time.sleep(0.1)
                _ip("netns", "del", h.ns, check=False)  # also removes the veth end inside it


def remove_stale() -> None:
    """Remove namespaces of earlier test runs whose process is gone (a run killed -9)."""
    listed = _ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({_PREFIX}-(\d+)x\d+-\d)\b", listed, flags=re.M):
        ns, pid = name
        if not os.path.exists(f"/proc/{pid}"):
            for p in Host(ns, "", "").pids():
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns, check=False)
