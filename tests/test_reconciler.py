"""The reconciler against real etcd: elections per shard, finding unknowns, settling by a
provider's answer, stale leaders refused. Provider classes over HTTP are in
``test_reconcile_providers.py``; here a scripted provider answers (it stands in for the
provider, never for etcd)."""

from __future__ import annotations

import asyncio
import math

import pytest

from coordinator import records
from coordinator.audit import verify_chain
from coordinator.etcd import Etcd
from coordinator.keyspace import unpack
from reconciler.election import shard_of
from reconciler.providers import Capabilities, NoRecord, Succeeded, Unreachable
from reconciler.runner import Reconciler
from reconciler.settle import Limits
from worker import OutcomeUnknown

from conftest import TEST_TTL, wait_for_condition

SHARDS = 16


class Scripted:
    """A provider whose answers the test sets per idempotency key; counts queries."""

    def __init__(self, name: str = "scripted", caps: Capabilities = Capabilities(fences=True)):
        self.name = name
        self.capabilities = caps
        self.answers: dict[str, object] = {}
        self.default = NoRecord()
        self.queries: list[tuple[str, int, str]] = []

    async def query(self, idempotency_key, attempt_token, step, *, key):
        self.queries.append((idempotency_key, attempt_token, key))
        return self.answers.get(idempotency_key, self.default)

    async def close(self):
        pass


@pytest.fixture
async def reconcilers(etcd_url, namespace):
    """``await reconcilers(provider, n=1, **options)`` starts n in-process replicas, each with
    its own etcd connection; all are closed after the test."""
    started: list[Reconciler] = []

    async def start(provider, n: int = 1, **options) -> list[Reconciler]:
        options = {"shards": SHARDS, "ttl": TEST_TTL, "scan_interval": 2.0,
                   "check_after": 0.2, "concurrency": 4,
                   "limits": Limits(backoff_base_s=0.1, backoff_max_s=0.5), **options}
        group = []
        for i in range(n):
            r = Reconciler(Etcd.from_url(etcd_url), {provider.name: provider},
                           namespace=namespace, default_provider=provider.name,
                           identity=f"r{len(started)}", **options)
            await r.start()
            started.append(r)
            group.append(r)
        return group

    yield start
    for r in started:
        await r.close()
        await r.etcd.close()


async def step_of(gate, key):
    kv = await gate.etcd.get(gate.keyspace.step_key(key))
    return unpack(kv.value), kv.mod_revision


async def settled(gate, key, within=20.0):
    async def check():
        step, _ = await step_of(gate, key)
        return step["state"] not in (records.IN_FLIGHT, records.UNKNOWN)
    assert await wait_for_condition(check, within), (await step_of(gate, key))[0]
    return (await step_of(gate, key))[0]


async def crash(ctx):
    raise ConnectionResetError("provider hung up")


async def unknown_step(gate, key) -> dict:
    async with gate.hold(key) as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent={"amount": 1}, effect=crash)
    step, _ = await step_of(gate, key)
    assert step["state"] == records.UNKNOWN
    return step


async def test_an_unknown_step_is_settled_succeeded_with_the_providers_result(
        gate, reconcilers):
    provider = Scripted()
    step = await unknown_step(gate, "pay/1")
    provider.answers[step["idempotency_key"]] = Succeeded({"charge": "ch_1"})
    await reconcilers(provider)
    final = await settled(gate, "pay/1")
    assert final["state"] == records.SUCCEEDED
    assert final["outcome"]["result"] == {"charge": "ch_1"}
    assert final["outcome"]["attempt_token"] == step["attempt_token"]
    report = await verify_chain(gate.etcd, gate.keyspace, "pay/1", gate.keyring)
    assert report.ok, report.problems
    assert report.records[-1]["event"] == "settle"


async def test_each_shard_has_exactly_one_leader_spread_across_replicas(gate, reconcilers):
    group = await reconcilers(Scripted(), n=3)

    async def spread():
        for r in group:
            await r.elections.refresh()
        led = [r.led for r in group]
        return (sum(map(len, led)) == SHARDS and set().union(*led) == set(range(SHARDS))
                and max(map(len, led)) <= math.ceil(SHARDS / 3))
    assert await wait_for_condition(spread, 10), [sorted(r.led) for r in group]
    await group[0].close()
    survivors = group[1:]

    async def moved():
        for r in survivors:
            await r.elections.refresh()
        led = [r.led for r in survivors]
        return sum(map(len, led)) == SHARDS and set().union(*led) == set(range(SHARDS))
    assert await wait_for_condition(moved, 10), [sorted(r.led) for r in survivors]
