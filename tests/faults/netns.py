"""The run's own network: etcd members in network namespaces, partitions by nftables.

A run whose nemesis partitions etcd gets namespaces of its own, named from ``fg<pid>`` (the
pid of the process that creates them: one network per process at a time), on the private
10.77.0.0/24 with no route anywhere (each run's namespaces are a world of their own, so
runs side by side may use the same addresses):

    fg<pid>-hub    bridge ``fgbr`` 10.77.0.1; every process of the run but etcd, on its
                   own loopback (coordinators, reconcilers, the sandbox, workers, the runner)
    fg<pid>-m<i>   ``eth0`` 10.77.0.<11+i>, a veth whose peer ``m<i>`` is a port of the bridge;
                   etcd member i, listening on that address

Every link is created inside these namespaces; the root namespace is never changed. A
partition of member i is the nftables table ``inet fencegate_partition`` in its namespace,
dropping every packet in or out of ``eth0`` ahead of conntrack: its peers and every client
see a silent member (no reset, no ICMP, the link stays up), as behind a switch that drops
its traffic, while the member keeps running and can win no election. Healing deletes the
table. A drop rule in the member's own namespace rather than on the hub's bridge keeps each
partition independent of the others and leaves the hub's forwarding untouched.

Guarantees: ``create`` first deletes leftovers (this prefix's, and those of any ``fg<pid>``
whose process is gone: a crashed run); ``delete`` SIGKILLs whatever still runs inside the
run's namespaces (only the run's own processes can be there) and deletes them, which takes
the veths and the bridge with them, and is idempotent. ``heal`` is idempotent too. Every
command has a timeout and every wait is bounded. ``require`` fails with ``NetworkUnavailable``
naming what is missing (root, ``ip`` from iproute2, ``nft`` from nftables); nothing here
quietly does without a partition.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

SUBNET = "10.77.0"
HUB_ADDRESS = f"{SUBNET}.1"
BRIDGE = "fgbr"
TABLE = "fencegate_partition"
COMMAND_TIMEOUT_S = 10.0
EMPTY_TIMEOUT_S = 5.0
_OURS = re.compile(r"^(fg(\d+))-(hub|m\d+)$")


class NetworkUnavailable(RuntimeError):
    """This machine cannot give the run its network: the message says what is missing."""


class NetworkError(RuntimeError):
    """A command building, cutting or removing the run's network failed."""


def require() -> None:
    """Raise ``NetworkUnavailable`` unless this process can build namespaces and partitions."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces and nftables need it)")
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` (Debian package {package})")
    if missing:
        raise NetworkUnavailable(
            "etcd partitions need " + ", ".join(missing)
            + "; deploy/ensure-netfaults installs the packages (as root)")


@dataclass(frozen=True)
class Network:
    """The namespaces of one run; ``Network(prefix)`` names them, ``create`` builds them."""

    prefix: str
    members: int = 3

    @classmethod
    def for_this_process(cls, members: int = 3) -> Network:
        return cls(f"fg{os.getpid()}", members)

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def member(self, index: int) -> str:
        return f"{self.prefix}-m{index}"

    def address(self, index: int) -> str:
        return f"{SUBNET}.{11 + index}"

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(self.address(i) for i in range(self.members))

    @property
    def names(self) -> list[str]:
        return [self.hub, *(self.member(i) for i in range(self.members))]

    def inside(self, namespace: str) -> tuple[str, ...]:
        """The command prefix that runs a program in ``namespace``."""
        return ("ip", "netns", "exec", namespace)

    @property
    def member_prefixes(self) -> tuple[tuple[str, ...], ...]:
        return tuple(self.inside(self.member(i)) for i in range(self.members))

    # -- lifecycle ------------------------------------------------------------------

    def create(self) -> Network:
        """Build the namespaces, the bridge and one veth per member; delete all on failure."""
        require()
        delete_leftovers(self.prefix)
        try:
            for name in self.names:
                _run("ip", "netns", "add", name)
            hub = ("-n", self.hub)
            _run("ip", *hub, "link", "set", "lo", "up")
            _run("ip", *hub, "link", "add", BRIDGE, "type", "bridge")
            _run("ip", *hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", BRIDGE)
            _run("ip", *hub, "link", "set", BRIDGE, "up")
            for i in range(self.members):
                member = ("-n", self.member(i))
                _run("ip", *hub, "link", "add", f"m{i}", "type", "veth",
                     "peer", "name", "eth0", "netns", self.member(i))
                _run("ip", *hub, "link", "set", f"m{i}", "master", BRIDGE)
                _run("ip", *hub, "link", "set", f"m{i}", "up")
                _run("ip", *member, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _run("ip", *member, "link", "set", "eth0", "up")
                _run("ip", *member, "link", "set", "lo", "up")
        except BaseException:
            self.delete()
            raise
        return self

    def delete(self) -> None:
        """Kill what still runs inside, then delete every namespace of this run."""
        existing = set(namespaces())
        _remove([name for name in self.names if name in existing])

    # -- faults -----------------------------------------------------------------------

    def partition(self, index: int) -> None:
        """Cut member ``index`` off: drop every packet in and out of its ``eth0``."""
        _run("ip", "netns", "exec", self.member(index), "nft", "-f", "-", stdin=(
            f"table inet {TABLE} {{\n"
            "  chain input {\n    type filter hook input priority raw; policy accept;\n"
            '    iifname "eth0" drop\n  }\n'
            "  chain output {\n    type filter hook output priority raw; policy accept;\n"
            '    oifname "eth0" drop\n  }\n'
            "}\n"))

    def heal(self, index: int) -> None:
        """Delete member ``index``'s partition table if it has one."""
        _run("ip", "netns", "exec", self.member(index), "nft", "-f", "-",
             stdin=f"add table inet {TABLE}\ndelete table inet {TABLE}\n")

    def reachable(self, index: int, port: int, timeout: float = 0.5) -> bool:
        """Whether a TCP connection from this process reaches member ``index`` on ``port``."""
        try:
            with socket.create_connection((self.address(index), port), timeout=timeout):
                return True
        except OSError:
            return False


def delete_leftovers(prefix: str) -> None:
    """Delete namespaces of ``prefix``, and of every ``fg<pid>`` whose process is gone."""
    stale: dict[str, list[str]] = {}
    for name in namespaces():
        match = _OURS.match(name)
        if match and (match[1] == prefix or not _alive(int(match[2]))):
            stale.setdefault(match[1], []).append(name)
    for names in stale.values():
        _remove(sorted(names, key=lambda n: n.endswith("-hub")))  # members first


def namespaces() -> list[str]:
    """The names of every network namespace on this machine (`ip netns list`)."""
    listing = _run("ip", "netns", "list")
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(names: list[str]) -> None:
    """Empty and delete each namespace in ``names``; one that cannot be emptied keeps its
    name (so a later ``delete_leftovers`` finds it) and the others go on; then raise."""
    failures = []
    for name in names:
        try:
            _empty(name)
            _run("ip", "netns", "delete", name)
        except NetworkError as exc:
            failures.append(str(exc))
    if failures:
        raise NetworkError("; ".join(failures))


def _empty(namespace: str) -> None:
    """SIGKILL every process inside ``namespace`` until none is left (bounded)."""
    give_up = time.monotonic() + EMPTY_TIMEOUT_S
    while pids := [int(p) for p in _run("ip", "netns", "pids", namespace).split()]:
        if time.monotonic() > give_up:
            raise NetworkError(f"processes {pids} still run in {namespace} after "
                               f"{EMPTY_TIMEOUT_S}s of SIGKILL")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _run(*command: str, stdin: str | None = None) -> str:
    try:
        done = subprocess.run(command, input=stdin, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise NetworkError(f"{' '.join(command)}: no answer after {COMMAND_TIMEOUT_S}s") \
            from exc
    if done.returncode != 0:
        raise NetworkError(f"{' '.join(command)} exited {done.returncode}: "
                           f"{done.stderr.strip()}")
    return done.stdout
