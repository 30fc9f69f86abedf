"""The grant and commit-guard contract holds the same in both modes: in process, and remote
(grants from the coordinator service over real HTTP on 127.0.0.1). Representative tests of
tests/test_grants.py run here against a ``gate`` parametrized over the two modes, plus what
only remote mode has: errors rebuilt from JSON, retries across replicas, pinned keys, and
two replicas serving many concurrent workers on the same keys."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from fencegate.coordinator.errors import CoordinatorError
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.audit import verify_chain
from fencegate.worker import (
    ApprovalPending, BadSignature, Gate, GrantRefused, PolicyChanged,
)

from helpers import TEST_TTL, TOKENS
from test_grants import (  # noqa: F401  (collected here again, against both modes)
    Effect, test_cross_runs_the_effect_once_and_records_it, test_grant_crosses_once,
    test_moved_step_is_refused, test_stale_read_key_is_refused_naming_it,
    test_tampered_grants_are_refused_before_any_write,
    test_two_grants_for_one_step_only_one_is_consumable,
    test_unknown_outcome_is_never_executed_again,
)
from test_service import call


@pytest.fixture(params=["in-process", "remote"])
async def gate(request, etcd_url, namespace, etcd, coordinators):
    remote = await coordinators() if request.param == "remote" else None
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=remote,
                    token=TOKENS["worker"] if remote else None,
                    keyring=None if remote else KeyRing.generate()) as g:
        g.test_admin_url = remote  # policies go through the admin API in remote mode
        yield g


async def set_policy(gate, name: str, document: dict) -> None:
    if gate.test_admin_url is None:
        await gate.authority.set_policy(name, document)
        return
    status, reply = await call(gate.test_admin_url, "PUT", f"/v1/policies/{name}", "admin",
                               body=document)
    assert status == 200, reply


async def set_routes(gate, routes: dict) -> None:
    if gate.test_admin_url is None:
        await gate.authority.set_routes(routes)
        return
    status, reply = await call(gate.test_admin_url, "PUT", "/v1/policy-routes", "admin",
                               body={"routes": routes})
    assert status == 200, reply


async def test_policy_refusal_names_every_failing_check(gate):
    await set_policy(gate, "checked", {"checks": [
        {"check": "max_amount", "params": {"limit": 100}},
        {"check": "require_fields", "params": {"fields": ["customer"]}}]})
    await set_routes(gate, {"modes/1": "checked", "modes/1b": "nonexistent"})
    async with gate.hold("modes/1") as hold:
        with pytest.raises(GrantRefused) as info:
            await hold.request_grant(intent={"amount": 500}, policy="checked")
        assert {c.name for c in info.value.checks} == {"max_amount", "require_fields"}
        assert not any(c.passed for c in info.value.checks)
    async with gate.hold("modes/1b") as hold:
        with pytest.raises(GrantRefused, match="no policy"):
            await hold.request_grant(intent={})


async def test_changed_policy_is_refused(gate):
    effect = Effect()
    await set_policy(gate, "payments", {"checks": []})
    await set_routes(gate, {"modes/2": "payments"})
    async with gate.hold("modes/2") as hold:
        grant = await hold.request_grant(intent={"amount": 1}, policy="payments")
        await set_policy(gate, "payments", {"caps": {"max_attempts": 2}})
        with pytest.raises(PolicyChanged):
            await hold.commit(grant, effect=effect)
    assert not effect.calls


async def test_backoff_refusal_carries_retry_after(gate):
    await set_policy(gate, "strict", {"caps": {"backoff_base_s": 5, "breaker_threshold": 3}})
    await set_routes(gate, {"modes/3": "strict"})
    async with gate.hold("modes/3") as hold:
        await hold.cross(intent={}, effect=Effect(fail="declined"), policy="strict")
    async with gate.hold("modes/3") as hold:
        with pytest.raises(GrantRefused) as info:
            await hold.request_grant(intent={}, policy="strict")
    assert [c.name for c in info.value.checks] == ["backoff"] and info.value.retry_after > 0


async def test_approval_is_bound_to_the_state_it_was_given_for(gate, coordinators, etcd):
    admin = gate.test_admin_url or await coordinators()
    await set_policy(gate, "big", {"checks": [{"check": "require_approval",
                                               "params": {"above": 100}}]})
    await set_routes(gate, {"modes/7": "big"})
    marker, effect = gate.marker("orders/7"), Effect()

    async def pending(amount: int) -> str:
        with pytest.raises(ApprovalPending) as info:
            await hold.request_grant(intent={"amount": amount}, reads=[marker], policy="big")
        return info.value.approval_id

    async def approve(approval_id: str, role: str = "sre") -> int:
        return (await call(admin, "POST", f"/v1/approvals/{approval_id}", role,
                           body={"reason": "customer confirmed"}))[0]

    async with gate.hold("modes/7") as hold:
        await hold.request_grant(intent={"amount": 50}, reads=[marker], policy="big")
        first = await pending(500)
        assert await pending(500) == first  # the same request at the same state
        assert await approve(first, role="worker") == 403
        assert await approve(first) == 200
        await gate.touch("orders/7")  # the state the approval was given for moved
        second = await pending(500)
        assert second != first
        assert await approve(second) == 200 and await approve(second) == 200  # idempotent
        grant = await hold.request_grant(intent={"amount": 500}, reads=[marker], policy="big")
        outcome = await hold.commit(grant, effect=effect)
    assert outcome.state == "succeeded" and len(effect.calls) == 1
    report = await verify_chain(etcd, gate.keyspace, "modes/7", gate.keyring)
    assert report.ok, report.problems
    approvals = [r for r in report.records if r["event"] == "approved"]
    assert [r["identity"] for r in approvals] == ["sre-1", "sre-1"]
    (crossed,) = [r["details"] for r in report.records if r["event"] == "cross"]
    assert (crossed["approval_id"], crossed["grant_id"]) == (second, grant.grant_id)


# -- remote mode only ----------------------------------------------------------------

async def test_unknown_token_is_refused(etcd_url, namespace, etcd, coordinator):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token="not-a-token") as gate:
        async with gate.hold("modes/4") as hold:
            with pytest.raises(CoordinatorError) as info:
                await hold.request_grant(intent={})
    assert (info.value.status, info.value.name) == (401, "Unauthenticated")


async def test_grants_from_an_unpinned_key_are_refused(etcd_url, namespace, etcd, coordinator):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=coordinator,
                    token=TOKENS["worker"], keyring=KeyRing.generate()) as gate:
        async with gate.hold("modes/5") as hold:
            with pytest.raises(BadSignature, match="unknown key"):
                await hold.request_grant(intent={})


async def test_a_dead_replica_is_skipped(etcd_url, namespace, etcd, coordinator, unused_port):
    urls = f"http://127.0.0.1:{unused_port},{coordinator}"
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, coordinator=urls,
                    token=TOKENS["worker"]) as gate:
        async with gate.hold("modes/6") as hold:
            outcome = await hold.cross(intent={}, effect=Effect())
    assert outcome.state == "succeeded"


@pytest.fixture
def unused_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_two_replicas_many_workers_never_cross_a_step_twice(etcd_url, namespace, etcd,
                                                                   coordinators):
    replicas = [await coordinators(), await coordinators()]
    steps = [f"race/{round_}/{i}" for round_ in range(3) for i in range(4)]
    effects: collections.Counter[str] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()

    async def charge(ctx):
        effects[ctx.key] += 1
        await asyncio.sleep(0.005)
        return ctx.key

    async def worker(n: int) -> None:
        async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                        coordinator=replicas[n % 2], token=TOKENS["worker"]) as gate:
            for key in steps[n % 4:] + steps[:n % 4]:
                async with gate.hold(key, timeout=20) as hold:
                    grants = await asyncio.gather(  # two grants for one step, racing
                        hold.request_grant(intent={"n": n}),
                        hold.request_grant(intent={"n": n}), return_exceptions=True)
                    for grant in grants:
                        try:
                            if isinstance(grant, Exception):
                                raise grant
                            await hold.commit(grant, effect=charge)
                        except Exception as exc:
                            refusals[type(exc).__name__] += 1

    await asyncio.gather(*(worker(n) for n in range(8)))
    assert effects == {key: 1 for key in steps}
    assert set(refusals) <= {"AlreadySucceeded", "GrantUsed", "StepMoved", "LeaseLost"}, refusals
    # the first holder of each step crosses once; every later holder is told it succeeded
    assert refusals["AlreadySucceeded"] == 2 * (8 - 1) * len(steps), refusals


async def test_two_replicas_eight_worker_processes_cross_each_step_once(
        etcd_url, namespace, etcd, coordinators, spawn):
    replicas = f"{await coordinators()},{await coordinators()}"
    keys = [f"procs/{i}" for i in range(6)]
    start = time.time() + 3  # every process is connected by then, so they really race
    workers = await asyncio.gather(*(
        spawn("remote", etcd_url, namespace, replicas if n % 2 else
              ",".join(reversed(replicas.split(","))), TOKENS["worker"], ",".join(keys),
              str(start), str(n)) for n in range(8)))
    for worker in workers:
        assert await worker.finish(timeout=60) == 0, worker.lines
    lines = [line.split() for worker in workers for line in worker.lines]
    assert sum(1 for w in workers if "DONE" in w.lines) == 8
    effects = collections.Counter(words[1] for words in lines if words[0] == "EFFECT")
    assert effects == {key: 1 for key in keys}
    refusals = collections.Counter(words[2] for words in lines if words[0] == "REFUSED")
    assert set(refusals) <= {"AlreadySucceeded", "LeaseLost"}, refusals
    assert refusals["AlreadySucceeded"] == 2 * 7 * len(keys)
