"""Fault injection helpers for ``elastic chaos``: nodes on their own network, a cut link.

:class:`Net` puts each node in its own network namespace (needs root and ``ip netns``): a
bridge in the root namespace with an address (etcd listens there), and per node a veth
pair whose inner end is the node's ``eth0``. :meth:`Net.link` takes a node's cable out and
puts it back; its processes live on, unreachable. :meth:`Net.close` removes everything it
created. The multi-node tests (``tests/multinode``) use the same network.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_usable() -> str:
    """Why network namespaces cannot be used here, or ``""`` when they can."""
    if shutil.which("ip") is None:
        return "the 'ip' command is missing"
    probe = f"elprobe{uuid.uuid4().hex[:5]}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"'ip netns add' failed ({made.stderr.strip() or 'needs root'})"
    ip("netns", "del", probe, check=False)
    return ""


def _free_subnet() -> ipaddress.IPv4Network:
    routes = ip("-4", "route", "show", "table", "all").stdout
    used = [ipaddress.ip_network(w, strict=False) for w in routes.split() if "/" in w]
    for third in range(100, 200):
        net = ipaddress.IPv4Network(f"10.214.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("No free 10.214.x.0/24 subnet is left for the chaos namespaces.")


@dataclass
class Net:
    """A bridge and the namespaces attached to it."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    subnet: ipaddress.IPv4Network = field(default_factory=_free_subnet)
    nodes: list[str] = field(default_factory=list)
    _bridge_up: bool = False

    @property
    def bridge(self) -> str:
        return f"ecb{self.tag}"

    @property
    def gateway(self) -> str:
        """The bridge's address: servers in the root namespace listen here."""
        return str(self.subnet.network_address + 1)

    def up(self) -> Net:
        ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_up = True
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        self._forward("-I")
        return self

    def _forward(self, action: str) -> None:
        # With br_netfilter loaded, bridged frames traverse iptables' FORWARD chain, whose
        # policy Docker sets to DROP: let traffic between our own namespaces through.
        if shutil.which("iptables"):
            rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
            subprocess.run(["iptables", action, *rule], capture_output=True, check=False)

    def add_node(self) -> tuple[str, str]:
        """Create one namespace; return (its name, its address)."""
        index = len(self.nodes)
        ns, host_end = f"ecn{self.tag}{index}", f"ecv{self.tag}{index}"
        addr = str(self.subnet.network_address + 10 + index)
        ip("netns", "add", ns)
        self.nodes.append(ns)
        ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", host_end, "master", self.bridge)
        ip("link", "set", host_end, "up")
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        return ns, addr

    def link(self, ns: str, up: bool) -> None:
        """Cut (or restore) a node's cable: its processes live on, unreachable."""
        index = self.nodes.index(ns)
        ip("link", "set", f"ecv{self.tag}{index}", "up" if up else "down")

    def close(self) -> None:
        for index, ns in enumerate(self.nodes):
            ip("link", "del", f"ecv{self.tag}{index}", check=False)
            ip("netns", "del", ns, check=False)
        self.nodes.clear()
        if self._bridge_up:
            ip("link", "del", self.bridge, check=False)
            self._forward("-D")
            self._bridge_up = False


__all__ = ["Net", "ip", "netns_usable"]
