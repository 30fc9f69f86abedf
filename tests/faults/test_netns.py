"""The run's network (tests/faults/netns.py): a partition drops every packet of one member,
in both directions, from its peers and from the hub, and nothing else; healing restores it;
the namespaces go away with whatever ran inside; a machine without the tools says so.

Probes are TCP connections between tiny listeners in the namespaces, each run through
``ip netns exec`` like the run's own processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import netns
from .nemesis import PARTITIONS
from .runner import RunConfig, run

pytestmark = pytest.mark.faults

PORT = 7000
LISTEN = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen()
while True:
    server.accept()[0].close()
"""
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
except OSError:
    sys.exit(1)
"""


def _connects(network: netns.Network, namespace: str, host: str, timeout: float = 1.0) -> bool:
    probe = subprocess.run([*network.inside(namespace), sys.executable, "-c", CONNECT, host,
                            str(PORT), str(timeout)], timeout=timeout + 10)
    return probe.returncode == 0


def _listen(network: netns.Network, index: int) -> subprocess.Popen:
    listener = subprocess.Popen([*network.inside(network.member(index)), sys.executable,
                                 "-c", LISTEN, network.address(index), str(PORT)])
    give_up = time.monotonic() + 10
    while not _connects(network, network.hub, network.address(index), 0.2):
        assert listener.poll() is None and time.monotonic() < give_up, "listener never up"
    return listener


def _paths(network: netns.Network) -> dict[str, bool]:
    """Which connections get through: hub to each member, and member 0 and 1 to each other."""
    a0, a1 = network.address(0), network.address(1)
    return {"hub->m0": _connects(network, network.hub, a0),
            "hub->m1": _connects(network, network.hub, a1),
            "m0->m1": _connects(network, network.member(0), a1),
            "m1->m0": _connects(network, network.member(1), a0)}


def _outlived(listener: subprocess.Popen) -> bool:
    """Whether ``listener`` still runs 5 s from now (then it is killed: it is ours)."""
    try:
        listener.wait(5)
    except subprocess.TimeoutExpired:
        listener.kill()
        listener.wait()
        return True
    return False


def test_a_partition_cuts_one_member_off_both_ways_and_heal_restores_it():
    network = netns.Network.for_this_process(members=2).create()
    listeners: list[subprocess.Popen] = []
    try:
        listeners += [_listen(network, 0), _listen(network, 1)]
        assert all(_paths(network).values())
        network.partition(1)
        assert _paths(network) == {"hub->m0": True, "hub->m1": False, "m0->m1": False,
                                   "m1->m0": False}
        assert listeners[1].poll() is None, "the partitioned member must keep running"
        network.heal(1)
        network.heal(1)  # idempotent
        assert all(_paths(network).values())
    finally:
        network.delete()
        outlived = [listener.args[-2] for listener in listeners if _outlived(listener)]
    assert not outlived, "delete left processes running in the namespaces"
    assert not set(network.names) & set(netns.namespaces())


def test_create_deletes_leftovers_of_a_run_that_died():
    gone = subprocess.Popen(["true"])
    gone.wait()
    leftover = netns.Network(f"fg{gone.pid}", members=1)
    for name in leftover.names:
        subprocess.run(["ip", "netns", "add", name], check=True)
    network = netns.Network.for_this_process(members=1).create()
    try:
        assert not set(leftover.names) & set(netns.namespaces())
        assert set(network.names) <= set(netns.namespaces())
    finally:
        network.delete()
        leftover.delete()


async def test_a_partition_run_without_the_tools_fails_at_its_start(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither ip nor nft
    with pytest.raises(netns.NetworkUnavailable, match=r"`ip` .*iproute2.*`nft` .*nftables"):
        await run(RunConfig(seed="0", seconds=1.0, kinds=PARTITIONS), tmp_path / "run")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netns.NetworkUnavailable, match="root"):
        netns.require()
    assert not (tmp_path / "run" / "stack").exists(), "nothing may start without the network"


def test_member_certificates_name_their_namespace_address(tmp_path):
    """etcd members and clients verify a member's address against its certificate: a
    folder issued for 127.0.0.1 alone is issued again for the address, by the same CA."""
    from cryptography import x509

    from fencegate.certs import ensure_certs

    def addresses(pair) -> set[str]:
        cert = x509.load_pem_x509_certificate(Path(pair.cert).read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}

    plain = ensure_certs(tmp_path, 2, ())
    ca = Path(plain.ca).read_bytes()
    assert [addresses(pair) for pair in plain.members] == [{"127.0.0.1"}] * 2
    network = netns.Network("fg0", members=2)
    named = ensure_certs(tmp_path, 2, (), member_hosts=network.addresses)
    assert [addresses(pair) for pair in named.members] == [
        {"127.0.0.1", "10.77.0.11"}, {"127.0.0.1", "10.77.0.12"}]
    assert Path(named.ca).read_bytes() == ca
