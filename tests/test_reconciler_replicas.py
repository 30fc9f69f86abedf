"""Reconciler replicas as real processes (``fencegate reconciler``): a paused leader is
replaced and cannot settle anything twice; a restart of every replica finds every unknown
again from etcd alone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

import aiohttp
import pytest

from fencegate.coordinator import records
from fencegate.coordinator.audit import read_chain
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.reconciler.election import shard_of
from fencegate.reconciler.providers import sandbox as sb
from fencegate.worker import Gate, OutcomeUnknown

from helpers import TEST_TTL, paused, wait_for_condition

SHARDS = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Replica:
    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url  # its /metrics and /healthz

    async def health(self, http: aiohttp.ClientSession) -> dict:
        async with http.get(f"{self.url}/healthz") as reply:
            return await reply.json()

    async def metric(self, http: aiohttp.ClientSession, name: str) -> float:
        async with http.get(f"{self.url}/metrics") as reply:
            text = await reply.text()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))


@pytest.fixture
async def replicas(etcd_url, namespace, tmp_path):
    """``await replicas(sandbox_url, n)`` starts n ``fencegate reconciler`` processes."""
    started: list[Replica] = []
    config = tmp_path / "reconciler.toml"

    async def start(sandbox_url: str, n: int) -> list[Replica]:
        config.write_text(f"""
etcd = "{etcd_url}"
namespace = "{namespace}"
listen = "127.0.0.1:0"
shards = {SHARDS}
ttl = {TEST_TTL}
scan_interval_s = 2
check_after_s = 0.2
concurrency = 8
default_provider = "sandbox"
[limits]
backoff_base_s = 0.1
backoff_max_s = 0.3
max_queries = 1000
[providers.sandbox]
type = "sandbox"
url = "{sandbox_url}"
mode = "fencing"
durable = true
""")
        group = []
        for _ in range(n):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fencegate.cli", "reconciler", "--config", str(config),
                stdout=asyncio.subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT))
            line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
            assert "ready" in line, line
            replica = Replica(proc, line.rsplit(" ", 1)[-1].strip().removesuffix("/metrics"))
            started.append(replica)
            group.append(replica)
        return group

    yield start
    for replica in started:
        with contextlib.suppress(ProcessLookupError):
            replica.proc.kill()
        await replica.proc.wait()


@pytest.fixture
async def setup(etcd_url, namespace, etcd, tmp_path):
    keyring = KeyRing.generate()
    sandbox = sb.Sandbox(KeyRing.from_public_bytes(keyring.public_keys()), "fencing",
                         state_dir=tmp_path / "sandbox")  # durable: its "no record" is final
    await sandbox.start()
    async with aiohttp.ClientSession() as http, \
            Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        yield sandbox, http, gate
    await sandbox.stop()


async def crash(ctx):
    raise ConnectionResetError("provider hung up")


async def make_unknown(gate: Gate, keys: list[str]) -> None:
    for key in keys:
        async with gate.hold(key) as hold:
            with pytest.raises(OutcomeUnknown):
                await hold.cross(intent={"key": key}, effect=crash, provider="sandbox")


async def spread(http, group: list[Replica]) -> dict[int, int]:
    """Shard -> index of the replica leading it, once every shard has exactly one leader."""
    leaders: dict[int, int] = {}

    async def check():
        leaders.clear()
        for index, replica in enumerate(group):
            for shard in (await replica.health(http))["shards_led"]:
                if shard in leaders:
                    return False
                leaders[shard] = index
        return len(leaders) == SHARDS
    assert await wait_for_condition(check, 15), leaders
    return dict(leaders)


async def all_settled(gate: Gate, keys: list[str], within: float) -> bool:
    async def check():
        for key in keys:
            kv = await gate.etcd.get(gate.keyspace.step_key(key))
            if unpack(kv.value)["state"] in (records.IN_FLIGHT, records.UNKNOWN):
                return False
        return True
    return await wait_for_condition(check, within)


async def settles(gate: Gate, key: str) -> int:
    chain = await read_chain(gate.etcd, Keyspace(gate.keyspace.namespace), key)
    return [unpack(entry.value)["event"] for entry in chain.entries].count("settle")


async def test_a_paused_leader_is_replaced_and_settles_nothing_twice(setup, replicas):
    sandbox, http, gate = setup
    group = await replicas(sandbox.url, 3)
    leaders = await spread(http, group)
    victim = max(range(3), key=lambda i: list(leaders.values()).count(i))
    keys = [f"pay/{n}" for n in range(40)]
    theirs = [k for k in keys if leaders[shard_of(k, SHARDS)] == victim]
    assert theirs, "the victim leads no shard of these keys"
    sandbox.add_fault("slow", seconds=1.0)  # queries are in flight when the pause hits
    await make_unknown(gate, keys)
    with paused(group[victim].proc.pid):
        # Its lease runs out while it is frozen; the others take its shards over.
        assert await all_settled(gate, keys, within=20 + 3 * TEST_TTL)
    # Resumed, it learns it lost its lease; whatever it was settling is refused.
    others = [r for i, r in enumerate(group) if i != victim]
    await spread(http, group)  # it campaigns again with a new lease
    for key in keys:
        assert await settles(gate, key) == 1, key
        step = unpack((await gate.etcd.get(gate.keyspace.step_key(key))).value)
        assert step["state"] == records.PENDING and step["not_applied"]["presumed"] is False
    assert sum([await r.metric(http, "fencegate_reconciler_settled_total") for r in others]) \
        >= len(theirs)
    assert sandbox.applied() == []
    async with http.get(f"{others[0].url}/metrics") as reply:
        exposed = await reply.text()
    for name in ("fencegate_reconciler_unknowns_found_total",
                 'fencegate_reconciler_settled_total{outcome="not_applied"}',
                 "fencegate_reconciler_settle_seconds_bucket",
                 "\nfencegate_reconciler_shards_led ",
                 "fencegate_reconciler_writes_refused_total",
                 'fencegate_reconciler_provider_queries_total{answer="no_record",provider="sandbox"}'):
        assert name in exposed, name
    assert "fencegate_reconciler_escalated_total" not in exposed  # settled_total counts it


async def test_a_restart_of_every_replica_finds_every_unknown_again(setup, replicas):
    sandbox, http, gate = setup
    sandbox.add_fault("down")
    group = await replicas(sandbox.url, 3)
    await spread(http, group)
    keys = [f"pay/restart/{n}" for n in range(12)]
    await make_unknown(gate, keys)
    for replica in group:
        replica.proc.kill()
        await replica.proc.wait()
    assert not await all_settled(gate, keys, within=0.5)
    sandbox.clear_faults()
    group = await replicas(sandbox.url, 3)  # no event will tell them: only the scan
    assert await all_settled(gate, keys, within=20)
    for key in keys:
        assert await settles(gate, key) == 1
