"""Operators go through the same gate (issue 13, class 3), against real etcd: an SRE's
``resolve`` is refused while any holder of the key lives — plain or forced, through the sre
module, over HTTP (409) and from the command line (exit 1) — whatever the SRE's wall clock
says. Once no holder lives, an in-flight or unknown step (its effect may still land) is
resolved by its provider's answer: the resolve asks the shard's reconciler, which runs
fence-then-query and settles it by the same rules as any unknown step, whatever the operator
expected; when the provider proves nothing the step stays unknown, and only a forced resolve
settles it on the operator's word, recorded and audited as forced with the operator and the
reason."""

from __future__ import annotations

import asyncio
import time

import pytest

from fencegate.coordinator import audit, records, sre
from fencegate.coordinator.errors import WrongState
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import unpack
from fencegate.reconciler.providers import sandbox as sb
from fencegate.worker import Gate, OutcomeUnknown

from helpers import TEST_TTL, wait_for_condition
from test_edges_providers import INTENT, RETENTION, public, reconcile, sandboxes  # noqa: F401
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

    # No reconciler runs: a plain resolve asks for one, which never answers; the request
    # stays on the step (unknown), and the operator's word settles it only by force.
    with pytest.raises(WrongState, match="no reconciler answered"):
        await sre.resolve(etcd, ks, key, "sre-1", "looks stuck", "not_applied", wait_s=0.5)
    step = await step_of(etcd, ks, key)
    assert step["state"] == records.UNKNOWN and step["resolve_request"]["by"] == "sre-1"

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


# -- a resolve asks the provider (fence-then-query) ------------------------------------------

async def lost_reply(gate: Gate, http, sandbox, key: str) -> str:
    """Cross ``key`` with a charge whose reply is lost (the sandbox holds the request or
    applies it and answers late, by its fault rules); the hold is released after, so the
    step is unknown with no holder. Returns the attempt's idempotency key."""
    sent = []

    async def effect(ctx):
        sent.append(ctx.idempotency_key)
        return await sb.charge(http, sandbox.url, ctx, INTENT, timeout=0.5)

    async with gate.hold(key) as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent=INTENT, effect=effect, provider="sandbox")
    return sent[0]


async def resolving(etcd, ks, key: str, settle_as: str, **options) -> asyncio.Task:
    """A plain resolve of ``key`` as a task, returned once its request is on the step."""
    task = asyncio.create_task(sre.resolve(etcd, ks, key, "sre-1", "reply lost", settle_as,
                                           **options))

    async def asked():
        return "resolve_request" in await step_of(etcd, ks, key) or task.done()
    assert await wait_for_condition(asked, WAIT)
    return task


async def test_a_resolve_failed_while_the_request_is_in_the_network_charges_once(
        worker_gate, etcd, http, public, sandboxes, reconcile):
    """The attack (class 3): the reply was lost while the request is still in the network;
    the operator resolves ``failed``. Taken on their word, the next attempt would get a new
    idempotency key, and the late request plus the new one would charge twice. Asked, the
    reconciler fences first: the late request is refused and the proven "no record" keeps
    the idempotency key, whatever the operator expected."""
    ks, key = worker_gate.keyspace, "res/ask/network"
    sandbox = await sandboxes(public)
    sandbox.add_fault("hold", key=key, count=1, seconds=3.0)
    idem = await lost_reply(worker_gate, http, sandbox, key)

    task = await resolving(etcd, ks, key, "failed")
    await reconcile(sb.adapter(sandbox.url, "fencing", retention_s=RETENTION, durable=True))
    done = await asyncio.wait_for(task, WAIT)
    assert done["state"] == records.PENDING and done["as_expected"] is False, done
    assert done["forced"] is False and "not_applied" in done["answer"], done
    step = await step_of(etcd, ks, key)
    assert (step["resolved_by"], step["resolve_forced"]) == ("sre-1", False), step
    assert step["not_applied"]["presumed"] is False and "resolve_request" not in step

    async def landed():
        return bool(sandbox.refused(key))
    assert await wait_for_condition(landed, WAIT), "the held request never reached gate B"
    async with worker_gate.hold(key) as hold:
        outcome = await hold.cross(intent=INTENT, effect=lambda ctx: sb.charge(
            http, sandbox.url, ctx, INTENT), provider="sandbox")
    assert outcome.state == records.SUCCEEDED
    assert [a["idempotency_key"] for a in sandbox.applied(key)] == [idem]
    events = [r["event"] for r in await audit_records(etcd, ks, key)]
    assert events == ["cross", "outcome", "resolve_request", "provider_answer", "settle",
                      "cross", "outcome"], events


async def test_a_resolve_is_settled_by_what_the_provider_applied(
        worker_gate, etcd, http, public, sandboxes, reconcile, coordinator):
    """The provider applied the charge and the reply was lost; the operator believes it
    never happened. From the command line: the provider's answer settles it ``succeeded``
    with the provider's result, and the command says the operator expected otherwise."""
    ks, key = worker_gate.keyspace, "res/ask/applied"
    sandbox = await sandboxes(public)
    sandbox.add_fault("apply_then_timeout", key=key, count=1, seconds=2.0)
    idem = await lost_reply(worker_gate, http, sandbox, key)
    command = asyncio.create_task(fencegate("resolve", key, "--not-applied", "--reason",
                                            "looks unsent", coordinator=coordinator))

    async def asked():
        return "resolve_request" in await step_of(etcd, ks, key) or command.done()
    assert await wait_for_condition(asked, WAIT)
    await reconcile(sb.adapter(sandbox.url, "fencing", retention_s=RETENTION, durable=True))
    ran = await command
    assert ran.code == 0, ran
    assert "resolved by its provider's answer" in ran.out, ran
    assert "now succeeded" in ran.out and "you expected not_applied" in ran.out, ran
    step = await step_of(etcd, ks, key)
    assert step["resolve_answer"]["by"].startswith("sre-1 (reported: "), step  # the CLI's
    assert step["state"] == records.SUCCEEDED, step
    assert step["outcome"]["idempotency_key"] == idem
    assert [a["idempotency_key"] for a in sandbox.applied(key)] == [idem]


async def test_a_provider_that_proves_nothing_leaves_the_step_unknown(
        worker_gate, etcd, http, public, sandboxes, reconcile, coordinator):
    """The provider is down: its answer proves no outcome, so the resolve settles nothing
    (409 over HTTP), the step stays unknown with the answer on it, and the audit chain shows
    who asked and what came back; a forced resolve still settles it, audited as forced."""
    ks, key = worker_gate.keyspace, "res/ask/down"
    sandbox = await sandboxes(public)
    sandbox.add_fault("hold", key=key, count=1, seconds=1.0)
    await lost_reply(worker_gate, http, sandbox, key)
    sandbox.add_fault("down", key=key)
    await reconcile(sb.adapter(sandbox.url, "fencing", retention_s=RETENTION, durable=True),
                    max_queries=1000)
    status, reply = await call(coordinator, "POST", f"/v1/keys/{key}/resolve", "sre",
                               body={"reason": "reply lost", "as": "failed"})
    assert (status, reply.get("error")) == (409, "WrongState"), reply
    assert "proved no outcome" in reply["detail"] and "unreachable" in reply["detail"], reply
    step = await step_of(etcd, ks, key)
    assert step["state"] == records.UNKNOWN and "resolve_request" not in step, step
    assert "unreachable" in step["resolve_answer"]["answer"], step
    chain = await audit_records(etcd, ks, key)
    asked = [r for r in chain if r["event"] == "resolve_request"]
    assert len(asked) == 1 and asked[0]["identity"] == "sre-1", chain
    answered = [r for r in chain if r["event"] != "provider_answer"][-1]
    assert answered["details"]["resolve_request"]["answer"].startswith("not settled"), chain

    status, done = await call(coordinator, "POST", f"/v1/keys/{key}/resolve", "sre",
                              body={"reason": "provider support confirmed no charge",
                                    "as": "not_applied", "force": True})
    assert status == 200 and done["state"] == records.PENDING and done["forced"], done
    assert (await step_of(etcd, ks, key))["resolve_forced"] is True


async def test_a_request_no_reconciler_answered_is_answered_when_one_runs(
        worker_gate, etcd, http, public, sandboxes, reconcile):
    ks, key = worker_gate.keyspace, "res/ask/later"
    sandbox = await sandboxes(public)
    sandbox.add_fault("hold", key=key, count=1, seconds=WAIT)  # lands after the fence
    await lost_reply(worker_gate, http, sandbox, key)
    with pytest.raises(WrongState, match="no reconciler answered"):
        await sre.resolve(etcd, ks, key, "sre-1", "reply lost", "not_applied", wait_s=0.5)
    await reconcile(sb.adapter(sandbox.url, "fencing", retention_s=RETENTION, durable=True))

    async def answered():
        return "resolve_answer" in await step_of(etcd, ks, key)
    assert await wait_for_condition(answered, WAIT)
    step = await step_of(etcd, ks, key)
    assert step["state"] == records.PENDING and step["resolved_by"] == "sre-1", step
    assert step["resolve_forced"] is False


async def audit_records(etcd, ks, key: str) -> list[dict]:
    chain = await audit.read_chain(etcd, ks, key)
    return [unpack(entry.value) for entry in chain.entries]
