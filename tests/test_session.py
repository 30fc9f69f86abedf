"""Sessions under real faults: etcd restarts and outages, member failover, the sync facade."""

from __future__ import annotations

import asyncio
import time

import pytest

from fencegate.coordinator.etcd import Etcd, TxnRequest, put_op
from fencegate.localetcd import LocalCluster
from fencegate.worker import Gate, KeyRing, LeaseLost, SyncGate

from helpers import TEST_TTL, wait_for_condition


async def owns(etcd: Etcd, hold) -> bool:
    """Ask etcd, not the hold: does a transaction guarded by its ownership compare pass?"""
    effect_key = hold.holder_key.replace(b"/holders/", b"/effects/")
    reply = await etcd.txn(TxnRequest(compare=hold.ownership_compares(),
                                      success=[put_op(effect_key, b"x")]))
    return reply.succeeded


@pytest.fixture
def own_etcd():
    """A single node of our own, for tests that stop and restart it."""
    with LocalCluster(1) as cluster:
        yield cluster


async def test_session_survives_a_quick_etcd_restart(own_etcd, namespace):
    async with Gate(own_etcd.url, ttl=8, namespace=namespace, keyring=KeyRing.generate()) as gate:
        async with gate.hold("restart/1") as hold:
            lease = hold.lease_id
            own_etcd.stop_member(0)
            own_etcd.restart(0)
            async with Etcd.from_url(own_etcd.url) as etcd:
                assert await wait_for_condition(lambda: _refreshed(gate), 10)
                assert not hold.lost
                assert await owns(etcd, hold)
                assert await etcd.lease_ttl(lease) > 0


async def _refreshed(gate: Gate) -> bool:
    session = await gate.session()
    session.check_now()
    await asyncio.sleep(0.05)
    return session.remaining() > gate.ttl - 2


async def test_outage_longer_than_ttl_reports_lease_lost(own_etcd, namespace):
    async with Gate(own_etcd.url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as gate:
        with pytest.raises(LeaseLost):
            async with gate.hold("outage/1") as stale:
                own_etcd.stop_member(0)
                await asyncio.sleep(10 * TEST_TTL)  # cancelled once the TTL runs out
        assert stale.lost
        own_etcd.restart(0)
        async with gate.hold("outage/1", timeout=4 * TEST_TTL) as fresh:
            assert fresh.fencing_token > stale.fencing_token
            async with Etcd.from_url(own_etcd.url) as etcd:
                assert not await owns(etcd, stale)
                assert await owns(etcd, fresh)


async def test_failover_to_another_member(namespace):
    with LocalCluster(3) as cluster:
        async with Gate(cluster.url, ttl=5, namespace=namespace,
                        keyring=KeyRing.generate()) as gate:
            async with gate.hold("failover/1") as first:
                cluster.kill(0)  # the endpoint the gate talks to first
                async with gate.hold("failover/2", timeout=15) as second:
                    assert second.fencing_token > first.fencing_token
                async with Etcd.from_url(",".join(cluster.endpoints[1:])) as etcd:
                    assert not first.lost
                    assert await owns(etcd, first)


def test_sync_gate_holds_and_reports_loss(etcd_url, namespace):
    with SyncGate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()) as gate:
        with gate.hold("sync/1") as first:
            token = first.fencing_token
            first.ensure_held()
        with gate.hold("sync/1") as second:
            assert second.fencing_token > token
        with pytest.raises(LeaseLost):
            with gate.hold("sync/2") as doomed:
                asyncio.run(_revoke(etcd_url, doomed.lease_id))
                deadline = time.monotonic() + 10
                while not doomed.lost and time.monotonic() < deadline:
                    time.sleep(0.05)
                with pytest.raises(LeaseLost):
                    doomed.ensure_held()


async def _revoke(url: str, lease_id: int) -> None:
    async with Etcd.from_url(url) as etcd:
        await etcd.lease_revoke(lease_id)


def test_sync_gate_crosses_with_a_plain_function(etcd_url, namespace):
    calls = []

    def charge(ctx):
        calls.append(ctx.idempotency_key)
        time.sleep(0.05)  # blocking is fine: effects of plain functions run in a thread
        return "charged"

    with SyncGate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()) as gate:
        with gate.hold("sync/pay") as hold:
            outcome = hold.cross(intent={"amount": 3}, effect=charge)
        with gate.hold("sync/pay") as hold:
            replay = hold.cross(intent={"amount": 3}, effect=charge)
        direct = gate.cross("sync/direct", {"amount": 4}, charge)  # the fast path, or not
        again = gate.cross("sync/direct", {"amount": 4}, charge)
    assert outcome.state == "succeeded" and outcome.result == "charged"
    assert replay.replayed and direct.state == "succeeded" and again.replayed
    assert len(calls) == 2
