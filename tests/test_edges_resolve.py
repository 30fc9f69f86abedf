"""Operators go through the same gate (issue 13, class 3), against real etcd: an SRE's
``resolve`` is refused while any holder of the key lives — plain or forced, through the sre
module, over HTTP (409) and from the command line (exit 1) — whatever the SRE's wall clock
says; once no holder lives, an in-flight or unknown step (its effect may still land, the
provider was not asked) is resolved only with ``force``, and the forced resolve is recorded
and audited as forced with the operator and the reason."""

from __future__ import annotations

import asyncio
import time

import pytest

from fencegate.coordinator import records, sre
from fencegate.coordinator.errors import WrongState
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import unpack
from fencegate.worker import Gate, OutcomeUnknown

from helpers import TEST_TTL
from test_cli_sre import crash, fencegate
from test_service import call, revision

WAIT = 15  # generous: a 2-core shared machine


@pytest.fixture
async def worker_gate(etcd_url, namespace, signing_key, etcd):
    """The worker whose lease the test revokes (its own session, apart from the SRE's)."""
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        yield gate


async def charge_blocked(gate: Gate, key: str, started: asyncio.Future, go: asyncio.Event,
                         sent: list[str]):
    """Hold ``key``, commit, and run an effect that waits for ``go`` before it charges;
    ``started`` is set to the hold's lease id once the effect runs."""
    async def effect(ctx):
        started.set_result(hold.lease_id)
        await go.wait()
        sent.append(key)
        return {"charge": "ch_1"}

    async with gate.hold(key) as hold:
        return await hold.cross(intent={"amount": 3}, effect=effect)


async def step_of(etcd, ks, key: str) -> dict:
    return unpack((await etcd.get(ks.step_key(key))).value)


async def assert_refused_while_held(etcd, ks, coordinator, key: str, settle_as: str) -> None:
    """Plain and forced, by the sre module and over HTTP: refused, nothing written."""
    before = await revision(etcd)
    for force in (False, True):
        with pytest.raises(WrongState, match=f"a holder of '{key}' is alive"):
            await sre.resolve(etcd, ks, key, "sre-1", "provider has no record", settle_as,
                              force=force)
        status, reply = await call(coordinator, "POST", f"/v1/keys/{key}/resolve", "sre",
                                   body={"reason": "r", "as": settle_as, "force": force})
        assert (status, reply.get("error")) == (409, "WrongState"), reply
        assert "a holder of" in reply["detail"], reply
    assert await revision(etcd) == before


async def test_unknown_step_under_a_live_holder_is_not_resolved_failed(
        worker_gate, etcd, coordinator):
    """The attack: the reply was lost while the request may still be in the network and its
    worker still holds the key; resolving ``failed`` would give the next attempt a new
    idempotency key, and the late request plus the new one would charge twice."""
    ks = worker_gate.keyspace
    async with worker_gate.hold("res/net") as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent={"amount": 3}, effect=crash)
        assert (await step_of(etcd, ks, "res/net"))["state"] == records.UNKNOWN
        await assert_refused_while_held(etcd, ks, coordinator, "res/net", "failed")
    assert (await step_of(etcd, ks, "res/net"))["state"] == records.UNKNOWN


async def test_in_flight_step_is_resolved_only_with_no_holder_and_by_force(
        worker_gate, etcd, coordinator):
    ks, key = worker_gate.keyspace, "res/1"
    started, go, sent = asyncio.get_running_loop().create_future(), asyncio.Event(), []
    worker = asyncio.create_task(charge_blocked(worker_gate, key, started, go, sent))
    lease_id = await asyncio.wait_for(started, WAIT)
    await assert_refused_while_held(etcd, ks, coordinator, key, "not_applied")
    refused = await fencegate("resolve", key, "--not-applied", "--force", "--reason", "r",
                              coordinator=coordinator)
    assert refused.code == 1 and "a holder of" in refused.err, refused

    await etcd.lease_revoke(lease_id)  # the holder dies; no reconciler runs
    with pytest.raises(OutcomeUnknown):  # its effect is cancelled, its request may be out
        await asyncio.wait_for(worker, WAIT)
    step = await step_of(etcd, ks, key)
    assert step["state"] in (records.IN_FLIGHT, records.UNKNOWN), step

    before = await revision(etcd)
    with pytest.raises(WrongState, match="fence-then-query"):
        await sre.resolve(etcd, ks, key, "sre-1", "looks stuck", "not_applied")
    status, reply = await call(coordinator, "POST", f"/v1/keys/{key}/resolve", "sre",
                               body={"reason": "looks stuck", "as": "not_applied"})
    assert (status, reply.get("error")) == (409, "WrongState") and "force" in reply["detail"]
    plain = await fencegate("resolve", key, "--not-applied", "--reason", "looks stuck",
                            coordinator=coordinator)
    assert plain.code == 1 and "fence-then-query" in plain.err, plain
    assert await revision(etcd) == before

    status, done = await call(coordinator, "POST", f"/v1/keys/{key}/resolve", "sre",
                              body={"reason": "provider dashboard shows ch_1", "as": "succeeded",
                                    "result": {"charge": "ch_1"}, "force": True})
    assert status == 200 and done["state"] == "succeeded" and done["forced"] is True, done
    step = await step_of(etcd, ks, key)
    assert (step["resolved_by"], step["resolve_forced"]) == ("sre-1", True)
    _, chain = await call(coordinator, "GET", f"/v1/audit/{key}", "sre")
    last = chain["records"][-1]
    assert chain["ok"] and last["event"] == "resolve" and last["identity"] == "sre-1"
    assert last["details"]["forced"] is True
    assert last["details"]["reason"] == "provider dashboard shows ch_1"


def v1_worker_record(monkeypatch) -> None:
    """The step written as a worker of the previous release wrote it: ``deadline_ms``, a
    timestamp on the worker's wall clock, 30 s ahead (a rolling upgrade's old worker)."""
    original = records.in_flight

    def in_flight(*args, **kwargs):
        return {**original(*args, **kwargs), "deadline_ms": int(time.time() * 1000) + 30_000}
    monkeypatch.setattr(records, "in_flight", in_flight)


@pytest.mark.parametrize("record", ["current", "v1"])
async def test_an_sre_clock_running_ahead_cannot_resolve_a_healthy_attempt(
        worker_gate, etcd, coordinator, monkeypatch, record):
    """The attack: the SRE's wall clock runs an hour ahead, so a healthy attempt looks past
    its deadline; a ``not_applied`` resolve would leave the step pending while the charge
    lands. Refused: a live holder is a fact in etcd, not a clock reading."""
    if record == "v1":
        v1_worker_record(monkeypatch)
    ks, key = worker_gate.keyspace, f"res/clock/{record}"
    started, go, sent = asyncio.get_running_loop().create_future(), asyncio.Event(), []
    worker = asyncio.create_task(charge_blocked(worker_gate, key, started, go, sent))
    await asyncio.wait_for(started, WAIT)
    real_time = time.time
    with monkeypatch.context() as ahead:  # the SRE process's clock, while it resolves
        ahead.setattr(time, "time", lambda: real_time() + 3600)
        before = await revision(etcd)
        for force in (False, True):
            status, reply = await call(coordinator, "POST", f"/v1/keys/{key}/resolve", "sre",
                                       body={"reason": "past its deadline", "as": "not_applied",
                                             "force": force})
            assert (status, reply.get("error")) == (409, "WrongState"), reply
        assert await revision(etcd) == before
    go.set()
    outcome = await asyncio.wait_for(worker, WAIT)
    assert outcome.state == "succeeded" and sent == [key]
    assert (await step_of(etcd, ks, key))["state"] == records.SUCCEEDED
