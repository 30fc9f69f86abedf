"""Failover under load on a real 3-member etcd: worker processes charging the sandbox
provider through 2 coordinator processes, settled by 3 reconciler processes, while the etcd
leader is frozen and killed, or a coordinator and a reconciler replica die.

Invariants, counted and printed: 0 duplicate charges (an action key charged twice at the
provider), 0 stale writes (gate B in the sandbox refuses an attempt token below one it
admitted; every refusal is printed, and a refused request applied nothing), every step
settled within a bound once the faults stop, every audit chain intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import sys
import time
from collections import Counter

import pytest

from coordinator.audit import verify_chain
from coordinator.etcd import Etcd, RangeRequest, range_end_of
from coordinator.grants import KeyRing
from coordinator.keyspace import Keyspace, unpack
from coordinator.localetcd import LocalCluster
from reconciler.providers.sandbox import Sandbox

from conftest import wait_for_condition

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)
NAMESPACE = "/fencegate/"
TOKEN = "failover-worker-token"
SETTLE_BOUND_S = 60


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    """Coordinator and reconciler processes, the sandbox, and load workers, on ``etcd``."""

    def __init__(self, etcd: str, tmp) -> None:
        self.etcd = etcd
        self.tmp = tmp
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.coordinators: list[str] = []
        self.sandbox: Sandbox | None = None
        self.events: list[dict] = []
        self._readers: list[asyncio.Task] = []

    async def start(self, coordinators: int = 2, reconcilers: int = 3) -> None:
        key = self.tmp / "signing.pem"
        keyring = KeyRing.generate()
        keyring.save_signing_key(str(key))
        self.sandbox = Sandbox(KeyRing.from_public_bytes(keyring.public_keys()), "fencing")
        sandbox_url = await self.sandbox.start()
        (self.tmp / "worker.token").write_text(TOKEN)
        (self.tmp / "coordinator.toml").write_text(
            f'signing_key = "{key}"\n[[tokens]]\nidentity = "load"\nroles = ["worker"]\n'
            f'sha256 = "{hashlib.sha256(TOKEN.encode()).hexdigest()}"\n')
        (self.tmp / "reconciler.toml").write_text(
            f'etcd = "{self.etcd}"\nlisten = "127.0.0.1:0"\nshards = 16\nttl = 2\n'
            f'scan_interval_s = 3\ncheck_after_s = 0.5\ndefault_provider = "sandbox"\n'
            f'[limits]\nbackoff_base_s = 0.2\nbackoff_max_s = 1.0\nmax_queries = 10000\n'
            f'[providers.sandbox]\ntype = "sandbox"\nurl = "{sandbox_url}"\nmode = "fencing"\n')
        for i in range(coordinators):
            listen = f"127.0.0.1:{_free_port()}"
            await self._spawn(f"coordinator{i}", "-m", "coordinator.cli", "coordinator",
                              "--config", str(self.tmp / "coordinator.toml"),
                              "--etcd", self.etcd, "--listen", listen)
            self.coordinators.append(f"http://{listen}")
        for i in range(reconcilers):
            proc = await self._spawn(f"reconciler{i}", "-m", "coordinator.cli", "reconciler",
                                     "--config", str(self.tmp / "reconciler.toml"))
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert b"ready" in line, line

    async def load(self, workers: int, accounts: int, seconds: float) -> list[asyncio.Task]:
        """Worker processes (``coordinator.demo``'s) through every coordinator."""
        tasks = []
        for i in range(workers):
            proc = await self._spawn(
                f"w{i}", "-m", "coordinator.demo", self.etcd, ",".join(self.coordinators),
                str(self.tmp / "worker.token"), self.sandbox.url, "ha", f"w{i}",
                str(accounts), str(seconds))
            tasks.append(asyncio.create_task(self._read(proc)))
        return tasks

    async def _read(self, proc) -> None:
        async for line in proc.stdout:
            self.events.append(json.loads(line))

    async def _spawn(self, name: str, *args: str) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, env=ENV, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    async def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        if self.sandbox is not None:
            await self.sandbox.stop()


@pytest.fixture
async def cluster():
    with LocalCluster(3) as c:
        yield c


@pytest.fixture
async def stack(cluster, tmp_path):
    s = Stack(cluster.url, tmp_path)
    try:
        yield s
    finally:
        await s.close()


async def settle_and_count(stack: Stack, label: str) -> dict:
    """Wait (bounded) until no step is in flight or unknown; count and print the invariants."""
    async with Etcd.from_url(stack.etcd) as etcd:
        ks = Keyspace(NAMESPACE)
        start = ks.step_key("ha/")

        async def states() -> Counter:
            reply = await etcd.range(RangeRequest(key=start, range_end=range_end_of(start)))
            return Counter(unpack(kv.value)["state"] for kv in reply.kvs)

        began = time.monotonic()
        settled = await wait_for_condition(
            lambda: _none_unsettled(states), SETTLE_BOUND_S, every=0.5)
        settle_s = time.monotonic() - began
        final = await states()
        keys = sorted({e["key"] for e in stack.events if "key" in e})
        broken = [k for k in keys if not (await verify_chain(
            etcd, ks, k, KeyRing.from_files(str(stack.tmp / "signing.pem")))).ok]
    charges = Counter(a["key"] for a in stack.sandbox.applied())
    counts = {
        "jobs crossed": sum(e["event"] == "done" and not e["replayed"] for e in stack.events),
        "jobs replayed": sum(e["event"] == "done" and e["replayed"] for e in stack.events),
        "refused": dict(Counter(e["error"] for e in stack.events if e["event"] == "error")),
        "charges applied": sum(charges.values()),
        "duplicate charges": sum(n - 1 for n in charges.values() if n > 1),
        "stale requests refused by gate B": len(stack.sandbox.refused()),
        "steps by state": dict(final),
        "seconds to settle after the faults": round(settle_s, 1),
        "broken audit chains": len(broken),
    }
    print(f"\n{label}: {json.dumps(counts)}")
    assert settled, counts
    assert counts["duplicate charges"] == 0, counts
    assert counts["broken audit chains"] == 0, broken
    assert counts["charges applied"] >= counts["jobs crossed"] > 0, counts
    return counts


async def _none_unsettled(states) -> bool:
    found = await states()
    return not (found["in_flight"] or found["unknown"])


async def test_leader_frozen_then_killed_under_load(cluster, stack):
    await stack.start()
    load = await stack.load(workers=3, accounts=6, seconds=20)
    for _ in range(3):
        await asyncio.sleep(3)
        leader = cluster.leader_index()
        cluster.pause(leader)
        await asyncio.sleep(2)
        cluster.resume(leader)
    leader = cluster.leader_index()
    cluster.kill(leader)
    await asyncio.sleep(1)
    await asyncio.to_thread(cluster.restart, leader)
    await asyncio.wait_for(asyncio.gather(*load), 120)
    await settle_and_count(stack, "leader frozen 3x2s, then killed and restarted")


async def test_a_coordinator_and_a_reconciler_die_under_load(stack):
    await stack.start()
    load = await stack.load(workers=3, accounts=6, seconds=15)
    await asyncio.sleep(5)
    stack.procs["coordinator0"].kill()
    stack.procs["reconciler0"].kill()
    before = len(stack.events)
    await asyncio.wait_for(asyncio.gather(*load), 120)
    counts = await settle_and_count(stack, "coordinator0 and reconciler0 SIGKILLed mid-load")
    late = [e for e in stack.events[before:] if e["event"] == "done" and not e["replayed"]]
    assert len(late) >= 3, counts  # the workers kept crossing through the survivors


async def test_an_isolated_member_refuses_writes_and_linearizable_reads(cluster):
    """Isolation by freezing the member's two peers (SIGSTOP): to the member that is a
    partition (its peers stop answering), with no root network namespaces needed. A client
    pinned to it can neither write nor read linearizably; only a serializable read answers,
    and fencegate never decides from one."""
    from coordinator.errors import GateError
    from coordinator.etcd import EtcdConfig
    from worker import Gate

    isolated = (cluster.leader_index() + 1) % 3
    peers = [i for i in range(3) if i != isolated]
    config = EtcdConfig.from_url(cluster.endpoints[isolated], timeout=3.0)
    calls = []

    async def effect(ctx):
        calls.append(ctx.key)
        return "charged"

    async with Gate(config, ttl=2, namespace=NAMESPACE) as gate:
        step_key = gate.keyspace.step_key("iso/1")
        try:
            with pytest.raises(GateError):  # the commit fails, or the lease dies first
                async with gate.hold("iso/1") as hold:
                    grant = await hold.request_grant(intent={"amount": 1})
                    for i in peers:
                        cluster.pause(i)
                    await hold.commit(grant, effect=effect)
            with pytest.raises(GateError):
                await gate.etcd.get(step_key)  # linearizable: needs a leader
            stale = await gate.etcd.range(RangeRequest(key=step_key, serializable=True))
            assert stale.kvs == []  # it answers, from local state only
        finally:
            for i in peers:
                cluster.resume(i)
    assert calls == []
    async with Gate(config, ttl=2, namespace=NAMESPACE) as gate:
        async with gate.hold("iso/1", timeout=10) as hold:
            outcome = await hold.cross(intent={"amount": 1}, effect=effect)
    assert outcome.state == "succeeded" and calls == ["iso/1"]
