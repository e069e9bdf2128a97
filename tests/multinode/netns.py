"""Several hosts on one machine: a bridge plus one network namespace per node.

Each node gets its own namespace with an ``eth0`` (one end of a veth pair whose
other end sits on a bridge in the root namespace) and its own address on a
private /24 that no route of this machine uses yet. The bridge carries an
address too, so a server in the root namespace (etcd) is reachable from every
node. Everything created here is removed by :meth:`Net.close`.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _free_subnet() -> ipaddress.IPv4Network:
    routes = ip("-4", "route", "show", "table", "all").stdout
    used = [ipaddress.ip_network(w, strict=False) for w in routes.split() if "/" in w]
    for third in range(200, 255):
        net = ipaddress.ip_network(f"10.213.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.213.x.0/24 subnet for the test namespaces")


@dataclass
class Net:
    """A bridge and the namespaces attached to it."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    subnet: ipaddress.IPv4Network = field(default_factory=_free_subnet)
    nodes: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"elb{self.tag}"

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    def up(self) -> Net:
        ip("link", "add", self.bridge, "type", "bridge")
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
        ns, host_end = f"eln{self.tag}{index}", f"elv{self.tag}{index}"
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
        ip("link", "set", f"elv{self.tag}{index}", "up" if up else "down")

    def close(self) -> None:
        for index, ns in enumerate(self.nodes):
            ip("link", "del", f"elv{self.tag}{index}", check=False)
            ip("netns", "del", ns, check=False)
        ip("link", "del", self.bridge, check=False)
        self._forward("-D")
        self.nodes.clear()
