"""Test hosts on one machine: network namespaces on a virtual LAN that the test makes and removes.

A switch namespace holds a bridge; each host namespace has one veth port on it, with its own address
on a private /24 of 10.231.N.0 (N unused on this host), and the root namespace has a port too (.1),
so the test itself, and daemons it runs outside the namespaces, reach every host. A host is cut off
by taking its switch port down (:meth:`Lan.cut`), and joined again with :meth:`Lan.heal`. No packet
leaves the test's own links; everything is removed on exit, even on failure.

Used by the partition test (two worker hosts cut off mid-job) and the multi-host test (a whole
cluster spread over four hosts, started through :class:`flexmarl.localcluster.LocalCluster` with a
:class:`NetnsRunner`, as ``flexmarl slurm`` starts one with srun).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import subprocess
from collections.abc import Iterator, Sequence

import pytest

from flexmarl.placement import Host, HostRunner


def ip(*args: str) -> None:
    """Runs `ip ARGS`; raises RuntimeError with its message when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _unused_subnet() -> int:
    """N such that nothing on this host uses 10.231.N.0/24."""
    used = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    used += subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    free = [n for n in range(256) if f"10.231.{n}." not in used]
    if not free:
        pytest.skip("every 10.231.N.0/24 is in use on this host")
    return random.choice(free)


@dataclasses.dataclass(frozen=True)
class LanHost:
    """One test host: its namespace, its address on the LAN and its port on the switch."""

    name: str
    netns: str
    address: str
    switch_port: str

    @property
    def host(self) -> Host:
        """As a placement host (the runner's name for it is its namespace)."""
        return Host(self.netns, self.address)


@dataclasses.dataclass(frozen=True)
class Lan:
    """The hosts of a virtual LAN and the root namespace's address on it."""

    switch_netns: str
    root_address: str
    hosts: dict[str, LanHost]

    def cut(self, *names: str) -> None:
        """Cuts hosts off the LAN (their switch ports down); their processes keep running."""
        for name in names:
            ip("-n", self.switch_netns, "link", "set", self.hosts[name].switch_port, "down")

    def heal(self, *names: str) -> None:
        """Joins cut-off hosts again."""
        for name in names:
            ip("-n", self.switch_netns, "link", "set", self.hosts[name].switch_port, "up")


class NetnsRunner(HostRunner):
    """Runs a host's processes in its network namespace (`ip netns exec` execs: the pid stays the same)."""

    def wrap(self, host: Host, argv: Sequence[str], *, name: str, gpus: int = 0) -> list[str]:
        """See :meth:`HostRunner.wrap`."""
        return ["ip", "netns", "exec", host.name, *argv]


@contextlib.contextmanager
def virtual_lan(names: Sequence[str]) -> Iterator[Lan]:
    """One namespace per name on a bridged LAN with the root namespace; all removed after."""
    if os.geteuid() != 0:
        pytest.skip("test hosts need root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("test hosts need `ip` (iproute2)")
    subnet = _unused_subnet()
    tag = f"{os.getpid() % 100_000}"
    switch = f"flexmarl-{tag}-switch"
    namespaces: list[str] = []
    root_port = f"fm{tag}root"
    try:
        try:
            ip("netns", "add", switch)
        except RuntimeError as exc:
            pytest.skip(f"network namespaces do not work here: {exc}")
        namespaces.append(switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        root_address = f"10.231.{subnet}.1"
        ip("link", "add", root_port, "type", "veth", "peer", "name", "root", "netns", switch)
        ip("addr", "add", f"{root_address}/24", "dev", root_port)
        ip("link", "set", root_port, "up")
        ip("-n", switch, "link", "set", "root", "master", "br0", "up")
        hosts: dict[str, LanHost] = {}
        for i, name in enumerate(names):
            host = LanHost(name=name, netns=f"flexmarl-{tag}-{name}", address=f"10.231.{subnet}.{i + 2}",
                           switch_port=f"port{i}")
            ip("netns", "add", host.netns)
            namespaces.append(host.netns)
            ip("-n", host.netns, "link", "add", "lan0", "type", "veth", "peer", "name", host.switch_port,
               "netns", switch)
            ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "lan0")
            ip("-n", host.netns, "link", "set", "lan0", "up")
            ip("-n", host.netns, "link", "set", "lo", "up")  # engine replicas listen on the host's loopback
            ip("-n", switch, "link", "set", host.switch_port, "master", "br0", "up")
            hosts[name] = host
        yield Lan(switch, root_address, hosts)
    finally:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            ip("link", "del", root_port)  # removes both ends
        for netns in reversed(namespaces):  # a namespace's veth ends go with it
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                ip("netns", "del", netns)
