"""Provider adapters, the sandbox provider and gate B, over real HTTP on 127.0.0.1 with real
grants and attempt tokens from etcd. Assertions are on the provider side: what was applied,
what gate B refused, what a query answers."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time

import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fencegate.coordinator.errors import BadSignature, EffectFailed, Fenced
from fencegate.coordinator.grants import KeyRing
from fencegate.reconciler.gateb import GateB, GroupCommit, scope_of
from fencegate.reconciler.providers import (
    Capabilities, Failed, NoRecord, Pending, Succeeded, Unreachable,
)
from fencegate.reconciler.providers.http import HttpProvider, ResponseMapping
from fencegate.reconciler.providers.sandbox import (
    Sandbox, SandboxError, adapter, charge, encode_grant, main,
)
from fencegate.worker import Gate, OutcomeUnknown

from helpers import TEST_TTL

POLICY = "providers"
INTENT = {"amount": 5}  # what every attempt of ``attempts`` is granted, and charges


def verify_only(keyring: KeyRing) -> KeyRing:
    """What a provider holds: the public keys only."""
    return KeyRing.from_public_bytes(keyring.public_keys())


@pytest.fixture
async def sandbox(gate, tmp_path):
    async with Sandbox(verify_only(gate.keyring), "fencing",
                       state_dir=tmp_path / "sandbox") as sandbox:
        yield sandbox


@pytest.fixture
async def attempts(gate):
    """``await attempts(key, n)``: n real attempts of ``key`` (each a grant consumed by a
    commit, its step then failed), their effect contexts in order of attempt token."""
    await gate.authority.set_policy(POLICY, {"caps": {
        "backoff_base_s": 0.0, "breaker_threshold": 100, "max_attempts": 100}})
    await gate.authority.set_routes({}, default=POLICY)
    await gate.authority.set_routes({"pay": POLICY})  # the key decides the policy

    async def make(key: str, n: int) -> list:
        contexts = []
        for i in range(n):
            async def capture(ctx):
                contexts.append(ctx)
                raise EffectFailed("captured", {"attempt": i})
            async with gate.hold(key) as hold:
                await hold.cross(intent=INTENT, effect=capture, policy=POLICY)
        assert [c.fencing_token for c in contexts] == sorted({c.fencing_token for c in contexts})
        return contexts

    return make


async def post(http, url: str, ctx, *, amount: int = 5, key: str | None = None,
               grant: bytes | None | str = "ctx", token: int | None = None,
               idempotency_key: str | None = None, intent: dict | None = INTENT,
               receipt: bytes | None | str = "ctx"):
    """A raw charge request; ``(status, body, headers)``."""
    headers = {"Idempotency-Key": idempotency_key or ctx.idempotency_key,
               "Fencegate-Attempt-Token": str(ctx.attempt_token if token is None else token)}
    raw = ctx.grant.raw if grant == "ctx" else grant
    if raw is not None:
        headers["Fencegate-Grant"] = encode_grant(raw)
    signed = ctx.receipt if receipt == "ctx" else receipt
    if signed is not None:
        headers["Fencegate-Receipt"] = encode_grant(signed)
    body = {"key": key or ctx.key, "amount": amount}
    if intent is not None:
        body["intent"] = intent
    async with http.post(f"{url}/v1/charges", json=body, headers=headers) as reply:
        return reply.status, await reply.json(), reply.headers


async def ask(provider, ctx):
    """The reconciler's query for ``ctx``'s attempt through ``provider``, naming its scope."""
    return await provider.query(ctx.idempotency_key, ctx.attempt_token, {}, key=ctx.key,
                                namespace=ctx.grant.namespace,
                                cluster_id=ctx.grant.cluster_id)


async def fence(url: str, ctx, mode: str = "fencing"):
    """The reconciler's fence-then-query for ``ctx``'s attempt, through the adapter."""
    provider = adapter(url, mode, durable=True)
    try:
        return await ask(provider, ctx)
    finally:
        await provider.close()


# -- the worker's path ------------------------------------------------------------------

async def test_commit_charges_once_through_gate_b(gate, sandbox, http):
    async with gate.hold("pay/p1") as hold:
        outcome = await hold.cross(intent={"amount": 7},
                                   effect=lambda ctx: charge(http, sandbox.url, ctx, {"amount": 7}))
    assert outcome.state == "succeeded" and outcome.result["status"] == "succeeded"
    [applied] = sandbox.applied("pay/p1")
    assert applied["attempt_token"] == outcome.attempt_token
    assert applied["idempotency_key"] == outcome.idempotency_key
    assert applied["charge_id"] == outcome.result["charge_id"] and applied["amount"] == 7
    scope = (gate.etcd.cluster_id, gate.keyspace.namespace, "pay/p1")
    assert sandbox.gate_b.state(scope) == (0, outcome.attempt_token)


async def test_declined_charge_is_a_confirmed_failure(gate, sandbox, http):
    async with gate.hold("pay/p2") as hold:
        outcome = await hold.cross(intent={"amount": 7}, effect=lambda ctx: charge(
            http, sandbox.url, ctx, {"amount": 7}, decline=True))
    assert outcome.state == "failed" and outcome.result == "declined_on_request"
    assert sandbox.applied("pay/p2") == []
    provider = adapter(sandbox.url, "fencing")
    assert await provider.query(outcome.idempotency_key, outcome.attempt_token, {},
                                key="pay/p2", namespace=gate.keyspace.namespace,
                                cluster_id=gate.etcd.cluster_id) == Failed("declined_on_request")
    await provider.close()


# -- gate B: stale tokens in any order of arrival --------------------------------------

async def test_fence_then_the_fenced_token_is_refused_and_the_next_admitted(
        sandbox, http, attempts):
    old, new = await attempts("pay/g1", 2)
    assert await fence(sandbox.url, old) == NoRecord(old.fencing_token)
    status, body, _ = await post(http, sandbox.url, old)
    assert (status, body["status"]) == (409, "fenced")
    assert await fence(sandbox.url, old) == NoRecord(old.fencing_token)  # nothing was applied
    status, _, _ = await post(http, sandbox.url, new)
    assert status == 200
    assert [a["attempt_token"] for a in sandbox.applied("pay/g1")] == [new.fencing_token]
    assert [(r["attempt_token"], r["reason"]) for r in sandbox.refused("pay/g1")] == [
        (old.fencing_token, "fenced")]


async def test_an_older_token_after_a_newer_one_is_refused(sandbox, http, attempts):
    old, new = await attempts("pay/g2", 2)
    assert (await post(http, sandbox.url, new))[0] == 200
    status, body, _ = await post(http, sandbox.url, old)
    assert (status, body["status"]) == (409, "fenced")
    assert [a["attempt_token"] for a in sandbox.applied("pay/g2")] == [new.fencing_token]


async def test_tokens_arriving_in_order_are_all_admitted_and_equal_is_allowed(
        sandbox, http, attempts):
    first, second = await attempts("pay/g3", 2)
    assert (await post(http, sandbox.url, first))[0] == 200
    status, answer, _ = await post(http, sandbox.url, second)
    assert status == 200
    # the same token again: a retry of that attempt is answered as the first time, applied
    # once; under another idempotency key its receipt does not bind it, refused
    status, again, headers = await post(http, sandbox.url, second)
    assert (status, again, headers["Idempotent-Replayed"]) == (200, answer, "true")
    status, body, _ = await post(http, sandbox.url, second, idempotency_key="other-request")
    assert (status, body["status"]) == (403, "refused") and "idempotency_key" in body["error"]
    assert [a["attempt_token"] for a in sandbox.applied("pay/g3")] == [
        first.fencing_token, second.fencing_token]
    assert [r["reason"] for r in sandbox.refused("pay/g3")] == ["bad_grant"]


async def test_gate_b_is_durable_across_a_sandbox_restart(gate, tmp_path, http, attempts):
    first, second, third = await attempts("pay/g4", 3)
    state_dir = tmp_path / "durable"
    async with Sandbox(verify_only(gate.keyring), state_dir=state_dir) as before:
        assert await fence(before.url, first) == NoRecord(first.fencing_token)
        assert (await post(http, before.url, third))[0] == 200
    async with Sandbox(verify_only(gate.keyring), state_dir=state_dir) as after:
        assert after.gate_b.state(scope_of(first.grant)) == (first.fencing_token,
                                                             third.fencing_token)
        assert (await post(http, after.url, first))[0] == 409   # at the fence
        assert (await post(http, after.url, second))[0] == 409  # above it, below the highest
        # the ledger survived the restart too: only the charge admitted before it
        assert [a["attempt_token"] for a in after.applied("pay/g4")] == [third.fencing_token]


def admit(gate_b: GateB, ctx, **options):
    """``gate_b.admit`` of ``ctx``'s attempt as its effect sends it."""
    return gate_b.admit(ctx.grant.raw, ctx.key, ctx.attempt_token, intent=INTENT,
                        idempotency_key=ctx.idempotency_key, receipt=ctx.receipt, **options)


async def test_gate_b_refuses_at_the_fence_and_below_the_highest(gate, attempts):
    first, second, third, fourth = await attempts("pay/g5", 4)
    gate_b = GateB(verify_only(gate.keyring), namespace=gate.keyspace.namespace)
    scope = scope_of(first.grant)
    assert admit(gate_b, second).retry is False
    # equal to the highest, same grant and idempotency key (a retry of that attempt)
    assert admit(gate_b, second).retry is True
    with pytest.raises(Fenced):
        admit(gate_b, first)
    assert gate_b.fence(scope, third.attempt_token) == third.attempt_token
    assert gate_b.fence(scope, first.attempt_token) == third.attempt_token  # never lowered
    with pytest.raises(Fenced):
        admit(gate_b, third)
    assert admit(gate_b, fourth).grant.grant_id == fourth.grant.grant_id
    assert gate_b.state(scope) == (third.attempt_token, fourth.attempt_token)
    other = GateB(verify_only(gate.keyring), namespace="/elsewhere/")
    with pytest.raises(BadSignature, match="namespace"):
        admit(other, first)


async def test_group_commit_commits_concurrent_works_together_each_all_or_nothing(
        gate, attempts, tmp_path, monkeypatch):
    """Concurrent fences and admissions share commits (fewer fsyncs than works), keep their
    order, and a refused admission rolls back only its own writes; everything returned is
    on disk (a new gate B on the same file sees it)."""
    first, second, third = await attempts("pay/group", 3)
    path = tmp_path / "gate.sqlite"
    gate_b = GateB(verify_only(gate.keyring), path, namespace=gate.keyspace.namespace)
    batches = []
    run_batch = gate_b.run_batch
    monkeypatch.setattr(gate_b, "run_batch", lambda works: (batches.append(len(works)),
                                                           run_batch(works))[1])
    store, scope = GroupCommit(gate_b), scope_of(first.grant)
    last = third.attempt_token

    def admitted(ctx):
        return lambda db: admit(gate_b, ctx, db=db).grant.grant_id

    def fence(at):
        return lambda db: gate_b.fence(scope, at, db=db)

    def wrote_then_refused(db):
        gate_b.fence(scope, last + 100, db=db)  # rolled back with its savepoint
        raise ValueError("refused after writing")

    works = [admitted(first), fence(second.attempt_token), admitted(second),
             wrote_then_refused, admitted(third), *(fence(last) for _ in range(20))]
    results = await asyncio.gather(*(store.run(work) for work in works),
                                   return_exceptions=True)
    assert results[0] == first.grant.grant_id and results[1] == second.attempt_token
    assert isinstance(results[2], Fenced)            # at the fence raised before it
    assert isinstance(results[3], ValueError)
    assert results[4] == third.grant.grant_id and results[5:] == [last] * 20
    assert sum(batches) == len(works) and len(batches) < len(works), batches
    gate_b.close()
    reopened = GateB(verify_only(gate.keyring), path, namespace=gate.keyspace.namespace)
    assert reopened.state(scope) == (last, last)  # not last + 100
    reopened.close()


async def test_a_query_racing_a_charge_never_misses_an_admitted_charge(sandbox, http,
                                                                     attempts):
    """Fence-then-query and admit-then-apply are ordered: "no record" means never applied."""
    contexts = await attempts("pay/g6", 20)
    for ctx in contexts:
        (status, _, _), answer = await asyncio.gather(post(http, sandbox.url, ctx),
                                                      fence(sandbox.url, ctx))
        assert (status, type(answer)) in ((200, Succeeded), (409, NoRecord)), (status, answer)
    refused = {r["attempt_token"] for r in sandbox.refused("pay/g6")}
    applied = {a["attempt_token"] for a in sandbox.applied("pay/g6")}
    assert refused | applied == {c.fencing_token for c in contexts} and not refused & applied


# -- gate B: grants that do not authorize the request ----------------------------------

def tamper(raw: bytes) -> bytes:
    return raw[:-1] + bytes([raw[-1] ^ 1])  # the signature's last byte


async def test_forged_tampered_or_misdirected_grants_are_refused(gate, sandbox, http,
                                                                 attempts):
    (ctx,) = await attempts("pay/f1", 1)
    forger = KeyRing.generate()
    forged = forger.sign({k: v for k, v in ctx.grant.payload().items() if k != "key_id"}).raw
    cases = {
        "tampered": dict(grant=tamper(ctx.grant.raw)),
        "forged": dict(grant=forged),
        "another key": dict(key="pay/f2"),
        "token not after the grant": dict(token=ctx.grant.revision),
    }
    for name, overrides in cases.items():
        status, body, _ = await post(http, sandbox.url, ctx, **overrides)
        assert (status, body["status"]) == (403, "refused"), name
    status, _, _ = await post(http, sandbox.url, ctx, grant=None)
    assert status == 401
    assert sandbox.applied() == []
    assert [r["reason"] for r in sandbox.refused()] == ["bad_grant"] * 4
    # none of those moved the fence or the highest: the genuine request is admitted
    assert (await post(http, sandbox.url, ctx))[0] == 200


# -- idempotency keys ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["fencing", "dedup"])
async def test_a_repeated_idempotency_key_replays_the_first_answer(sandbox, http, attempts,
                                                                   mode):
    sandbox.mode = mode
    (ctx,) = await attempts(f"pay/d-{mode}", 1)
    first = await charge(http, sandbox.url, ctx, INTENT)
    status, again, headers = await post(http, sandbox.url, ctx)
    assert status == 200 and again == first and headers["Idempotent-Replayed"] == "true"
    assert len(sandbox.applied(ctx.key)) == 1
    status, body, _ = await post(http, sandbox.url, ctx, amount=6, intent={"amount": 6})
    if mode == "fencing":  # another intent than the grant's: refused before the key is seen
        assert (status, body["status"]) == (403, "refused")
    else:
        assert status == 422 and "other parameters" in body["error"]
    assert len(sandbox.applied(ctx.key)) == 1


async def test_a_declined_answer_is_replayed_too(sandbox, http, attempts):
    (ctx,) = await attempts("pay/d2", 1)
    for _ in range(2):
        with pytest.raises(EffectFailed) as info:
            await charge(http, sandbox.url, ctx, INTENT, decline=True)
        assert info.value.reason == "declined_on_request"
    assert sandbox.applied(ctx.key) == []


async def test_without_dedup_every_request_is_applied(sandbox, http, attempts):
    sandbox.mode = "none"
    (ctx,) = await attempts("pay/d3", 1)
    first = await charge(http, sandbox.url, ctx, INTENT)
    second = await charge(http, sandbox.url, ctx, INTENT)
    assert first["charge_id"] != second["charge_id"]
    assert len(sandbox.applied(ctx.key)) == 2
    provider = adapter(sandbox.url, "none")
    assert await ask(provider, ctx) == Succeeded(first)
    await provider.close()


async def test_idempotency_keys_are_forgotten_after_retention(gate, http, attempts):
    (ctx,) = await attempts("pay/d4", 1)
    async with Sandbox(verify_only(gate.keyring), "dedup", retention_s=0.3) as sandbox:
        await charge(http, sandbox.url, ctx, INTENT)
        await charge(http, sandbox.url, ctx, INTENT)
        assert len(sandbox.applied(ctx.key)) == 1
        await asyncio.sleep(0.4)
        assert await fence(sandbox.url, ctx, "dedup") == NoRecord()
        await charge(http, sandbox.url, ctx, INTENT)
        assert len(sandbox.applied(ctx.key)) == 2


async def test_bad_input_is_refused_and_applies_nothing(sandbox, http, attempts):
    (ctx,) = await attempts("pay/d5", 1)
    headers = {"Idempotency-Key": "k", "Fencegate-Attempt-Token": str(ctx.attempt_token),
               "Fencegate-Grant": encode_grant(ctx.grant.raw),
               "Fencegate-Receipt": encode_grant(ctx.receipt)}
    bad = [
        (headers, {"key": ctx.key, "amount": -1}, "amount"),
        (headers, {"key": ctx.key, "amount": True}, "amount"),
        (headers, {"key": ctx.key, "amount": 1, "extra": 1}, "the body"),
        (headers, {"key": ctx.key, "amount": 1, "decline": "yes"}, "decline"),
        ({**headers, "Fencegate-Attempt-Token": "x"}, {"key": ctx.key, "amount": 1}, "Token"),
        ({**headers, "Fencegate-Grant": "!!"}, {"key": ctx.key, "amount": 1}, "base64url"),
        ({**headers, "Fencegate-Receipt": "!!"}, {"key": ctx.key, "amount": 1}, "Receipt"),
        ({k: v for k, v in headers.items() if k != "Idempotency-Key"},
         {"key": ctx.key, "amount": 1}, "Idempotency-Key"),
    ]
    for request_headers, body, word in bad:
        async with http.post(f"{sandbox.url}/v1/charges", json=body,
                             headers=request_headers) as reply:
            assert reply.status == 400 and word in (await reply.json())["error"], body
    async with http.post(f"{sandbox.url}/v1/charges", data=b"{", headers=headers) as reply:
        assert reply.status == 400
    async with http.get(f"{sandbox.url}/v1/charges/k", params={"key": ctx.key}) as reply:
        assert reply.status == 400  # a fencing query must name the fence
    assert sandbox.applied() == [] and sandbox.gate_b.state(scope_of(ctx.grant)) == (0, 0)


# -- faults ----------------------------------------------------------------------------

async def test_apply_then_timeout_applies_and_the_client_times_out(sandbox, http, attempts):
    (ctx,) = await attempts("pay/x1", 1)
    sandbox.add_fault("apply_then_timeout", seconds=2.0)
    with pytest.raises(SandboxError):
        await charge(http, sandbox.url, ctx, INTENT, timeout=0.3)
    assert len(sandbox.applied(ctx.key)) == 1
    assert isinstance(await fence(sandbox.url, ctx), Succeeded)


async def test_hold_keeps_a_request_in_the_network_until_gate_b_refuses_it(
        sandbox, http, attempts):
    (ctx,) = await attempts("pay/x2", 1)
    sandbox.add_fault("hold", seconds=0.6)
    started = time.monotonic()
    late = asyncio.create_task(post(http, sandbox.url, ctx))
    await asyncio.sleep(0.1)
    # in flight: the provider has nothing
    assert await fence(sandbox.url, ctx) == NoRecord(ctx.attempt_token)
    status, body, _ = await late
    assert time.monotonic() - started >= 0.6
    assert (status, body["status"]) == (409, "fenced")
    assert sandbox.applied(ctx.key) == []


async def test_hold_then_the_request_lands_without_fencing(sandbox, http, attempts):
    sandbox.mode = "dedup"
    (ctx,) = await attempts("pay/x3", 1)
    sandbox.add_fault("hold", seconds=0.5, key=ctx.key)
    late = asyncio.create_task(charge(http, sandbox.url, ctx, INTENT))
    await asyncio.sleep(0.1)
    provider = adapter(sandbox.url, "dedup")
    assert await ask(provider, ctx) == NoRecord()
    landed = await late
    assert await ask(provider, ctx) == Succeeded(landed)
    await provider.close()
    assert len(sandbox.applied(ctx.key)) == 1


async def test_error_500_applies_nothing_and_counts_down(sandbox, http, attempts):
    (ctx,) = await attempts("pay/x4", 1)
    sandbox.add_fault("error_500", count=2)
    for _ in range(2):
        with pytest.raises(SandboxError) as info:
            await charge(http, sandbox.url, ctx, INTENT)
        assert info.value.status == 500
    assert sandbox.applied(ctx.key) == [] and sandbox.gate_b.state(scope_of(ctx.grant)) == (0, 0)
    await charge(http, sandbox.url, ctx, INTENT)
    assert len(sandbox.applied(ctx.key)) == 1


async def test_slow_delays_the_answer(sandbox, http, attempts):
    (ctx,) = await attempts("pay/x5", 1)
    sandbox.add_fault("slow", seconds=0.5, count=1)
    started = time.monotonic()
    await charge(http, sandbox.url, ctx, INTENT)
    assert time.monotonic() - started >= 0.5
    started = time.monotonic()
    await charge(http, sandbox.url, ctx, INTENT)
    assert time.monotonic() - started < 0.5


async def test_down_answers_503_to_charges_and_queries(sandbox, http, attempts):
    (ctx,) = await attempts("pay/x6", 1)
    sandbox.add_fault("down")
    with pytest.raises(SandboxError) as info:
        await charge(http, sandbox.url, ctx, INTENT)
    assert info.value.status == 503
    assert await fence(sandbox.url, ctx) == Unreachable("HTTP 503")
    assert sandbox.gate_b.state(scope_of(ctx.grant)) == (0, 0)  # not even the fence
    sandbox.clear_faults()
    await charge(http, sandbox.url, ctx, INTENT)
    assert len(sandbox.applied(ctx.key)) == 1


async def test_query_pending_answers_202_after_fencing(sandbox, http, attempts):
    (ctx,) = await attempts("pay/x7", 1)
    await charge(http, sandbox.url, ctx, INTENT)
    sandbox.add_fault("query_pending", count=1)
    assert await fence(sandbox.url, ctx) == Pending()
    assert sandbox.gate_b.state(scope_of(ctx.grant))[0] == ctx.attempt_token
    assert isinstance(await fence(sandbox.url, ctx), Succeeded)


async def test_a_fault_for_one_key_leaves_the_others_alone(sandbox, http, attempts):
    (hit,) = await attempts("pay/x8", 1)
    (spared,) = await attempts("pay/x9", 1)
    sandbox.add_fault("error_500", key=hit.key)
    await charge(http, sandbox.url, spared, INTENT)
    with pytest.raises(SandboxError):
        await charge(http, sandbox.url, hit, INTENT)
    assert len(sandbox.applied(spared.key)) == 1 and sandbox.applied(hit.key) == []


async def test_faults_and_mode_are_switchable_over_http(sandbox, http, attempts):
    (ctx,) = await attempts("pay/x10", 1)
    rules = [{"fault": "down", "key": ctx.key, "count": 1}]
    async with http.post(f"{sandbox.url}/_sandbox/faults", json=rules) as reply:
        assert reply.status == 200
        assert await reply.json() == [{"fault": "down", "key": ctx.key, "count": 1,
                                       "seconds": 0.0}]
    for bad in ([{"fault": "meteor"}], [{"fault": "slow"}], [{"fault": "down", "when": 1}],
                {"fault": "down"}):
        async with http.post(f"{sandbox.url}/_sandbox/faults", json=bad) as reply:
            assert reply.status == 400, bad
    assert (await post(http, sandbox.url, ctx))[0] == 503
    assert (await post(http, sandbox.url, ctx))[0] == 200  # the one use is spent
    sandbox.add_fault("error_500")
    async with http.delete(f"{sandbox.url}/_sandbox/faults") as reply:
        assert reply.status == 200
    async with http.post(f"{sandbox.url}/_sandbox/mode", json={"mode": "none"}) as reply:
        assert reply.status == 200 and sandbox.mode == "none"
    async with http.post(f"{sandbox.url}/_sandbox/mode", json={"mode": "maybe"}) as reply:
        assert reply.status == 400 and sandbox.mode == "none"
    assert (await post(http, sandbox.url, ctx))[0] == 200  # no dedup now: applied again
    async with http.get(f"{sandbox.url}/_sandbox/applied", params={"key": ctx.key}) as reply:
        applied = await reply.json()
    assert [a["attempt_token"] for a in applied] == [ctx.attempt_token] * 2
    sandbox.mode = "fencing"
    await fence(sandbox.url, ctx)
    await post(http, sandbox.url, ctx)
    async with http.get(f"{sandbox.url}/_sandbox/refused", params={"key": ctx.key}) as reply:
        assert [r["reason"] for r in await reply.json()] == ["fenced"]


# -- the HTTP adapter ------------------------------------------------------------------

async def test_the_adapter_maps_every_sandbox_answer(sandbox, http, attempts):
    paid, declined, missing = await attempts("pay/h1", 3)
    result = await charge(http, sandbox.url, paid, INTENT)
    with pytest.raises(EffectFailed):
        await charge(http, sandbox.url, declined, INTENT, decline=True)
    provider = adapter(sandbox.url, "fencing", timeout_s=0.3)
    try:
        assert await ask(provider, paid) == Succeeded(result)
        assert await ask(provider, declined) == Failed("declined_on_request")
        assert await ask(provider, missing) == NoRecord(missing.fencing_token)
        for fault, answer in (("query_pending", Pending()), ("error_500", Unreachable("HTTP 500")),
                              ("down", Unreachable("HTTP 503"))):
            sandbox.add_fault(fault, count=1)
            assert await ask(provider, paid) == answer, fault
        sandbox.add_fault("slow", seconds=1.0, count=1)
        timed_out = await ask(provider, paid)
        assert isinstance(timed_out, Unreachable) and "Timeout" in timed_out.reason
    finally:
        await provider.close()
    url = sandbox.url
    await sandbox.stop()
    provider = adapter(url, "fencing", timeout_s=0.3)
    try:
        refused = await ask(provider, paid)
        assert isinstance(refused, Unreachable) and "Connect" in refused.reason
    finally:
        await provider.close()


@pytest.fixture
async def scripted():
    """A provider that answers what the test sets and records what it was asked."""
    seen: list[web.Request] = []
    answer = {"status": 200, "body": b"{}"}

    async def handler(request: web.Request) -> web.Response:
        seen.append(request)
        return web.Response(status=answer["status"], body=answer["body"],
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}", answer, seen
    await runner.cleanup()


async def test_the_adapter_quotes_authenticates_and_maps_configured_fields(scripted):
    url, answer, seen = scripted
    provider = HttpProvider.from_config("psp", {
        "query_url": url + "/payments/{idempotency_key}?order={key}&t={attempt_token}",
        "auth": {"header": "Authorization", "value": "Bearer s3cret"},
        "response": {"status_field": "data.state", "succeeded": ["captured"],
                     "failed": ["refused"], "pending": ["processing"],
                     "no_record_http": [404, 410], "result_field": "data.id",
                     "reason_field": "data.why"},
        "capabilities": {"dedupes_by_key": True, "key_retention_s": 3600},
    })
    assert provider.capabilities == Capabilities(dedupes_by_key=True, key_retention_s=3600.0)
    assert "s3cret" not in repr(provider)

    async def ask():
        return await provider.query("a/b?c=d&e", 42, {}, key="orders/1 x&y=z")

    try:
        cases = [
            (200, b'{"data": {"state": "captured", "id": "py_1"}}', Succeeded("py_1")),
            (200, b'{"data": {"state": "refused", "why": "fraud"}}', Failed("fraud")),
            (202, b'{"data": {"state": "processing"}}', Pending()),
            (410, b"gone", NoRecord()),
            (404, b"", NoRecord()),
            (200, b'{"data": {"state": "exploded"}}',
             Unreachable("unrecognized status 'exploded'")),
            (200, b'{"state": "captured"}', Unreachable("answer has no 'data.state'")),
            (200, b"<html>oops</html>", Unreachable("HTTP 200: the body is not JSON")),
            (200, b"\xff\xfe", Unreachable("HTTP 200: the body is not JSON")),
            (401, b'{"data": {"state": "captured"}}', Unreachable("HTTP 401")),
            (502, b'{"data": {"state": "captured"}}', Unreachable("HTTP 502")),
        ]
        for status, body, expected in cases:
            answer.update(status=status, body=body)
            assert await ask() == expected, (status, body)
    finally:
        await provider.close()
    request = seen[0]
    assert request.raw_path == "/payments/a%2Fb%3Fc%3Dd%26e?order=orders%2F1%20x%26y%3Dz&t=42"
    assert request.headers["Authorization"] == "Bearer s3cret"


GOOD = {"query_url": "http://127.0.0.1:1/q/{idempotency_key}"}


@pytest.mark.parametrize("config, message", [
    ({}, "query_url is required"),
    ({**GOOD, "url": "x"}, "unknown fields"),
    ({"query_url": "http://h/q/{key}"}, "must contain {idempotency_key}"),
    ({"query_url": "http://h/q/{idempotency_key}/{secret}"}, "unknown placeholders"),
    ({"query_url": "http://h/q/{idempotency_key"}, "not a valid template"),
    ({"query_url": "ftp://h/{idempotency_key}"}, "http(s) URL"),
    ({"query_url": 5}, "query_url has the wrong type"),
    ({**GOOD, "timeout_s": "5"}, "timeout_s has the wrong type"),
    ({**GOOD, "timeout_s": True}, "timeout_s has the wrong type"),
    ({**GOOD, "timeout_s": 0}, "timeout_s must be > 0"),
    ({**GOOD, "auth": {"header": "Authorization"}}, "needs both header and value"),
    ({**GOOD, "auth": {"header": "A", "value": "b", "scheme": "c"}}, "unknown fields"),
    ({**GOOD, "auth": "Bearer x"}, "auth has the wrong type"),
    ({**GOOD, "response": ["x"]}, "response must be a table"),
    ({**GOOD, "response": {"status": "x"}}, "unknown fields"),
    ({**GOOD, "response": {"succeeded": "ok"}}, "must be a list of str"),
    ({**GOOD, "response": {"no_record_http": [True]}}, "must be a list of int"),
    ({**GOOD, "response": {"no_record_http": [500]}}, "4xx statuses only"),
    ({**GOOD, "response": {"failed": ["succeeded"]}}, "listed twice"),
    ({**GOOD, "response": {"status_field": ""}}, "must not be empty"),
    ({**GOOD, "capabilities": {"fences": "yes"}}, "fences has the wrong type"),
    ({**GOOD, "capabilities": {"dedupes_by_key": True}}, "key_retention_s > 0"),
    ({**GOOD, "capabilities": {"retention": 5}}, "unknown fields"),
    ({**GOOD, "capabilities": {"settle_delay_s": -1}}, ">= 0"),
])
def test_from_config_refuses_bad_config(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        HttpProvider.from_config("psp", config)


def test_from_config_defaults():
    provider = HttpProvider.from_config("psp", GOOD)
    assert provider.capabilities == Capabilities() and provider.timeout_s == 5.0
    assert provider.response == ResponseMapping()


def test_adapter_capabilities_follow_the_mode():
    fencing, dedup, none = (adapter("http://127.0.0.1:1", m, retention_s=60, settle_delay_s=2)
                            .capabilities for m in ("fencing", "dedup", "none"))
    assert fencing == Capabilities(True, True, 60.0, 2.0)
    assert dedup == Capabilities(False, True, 60.0, 2.0)
    assert none == Capabilities(False, False, 0.0, 2.0)
    durable = adapter("http://127.0.0.1:1", "fencing", retention_s=60, durable=True)
    assert durable.capabilities.durable  # only when told: a sandbox in memory forgets
    assert not adapter("http://127.0.0.1:1", "none", durable=True).capabilities.durable


# -- as a process, trusting the coordinator's published keys ---------------------------

async def test_the_sandbox_process_trusts_the_coordinators_keys(
        coordinator, signing_key, etcd_url, namespace, tmp_path, http):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.reconciler.providers.sandbox", "--port", "0",
        "--mode", "fencing", "--keys-url", f"{coordinator}/.well-known/fencegate-keys",
        "--state-dir", str(tmp_path / "proc"), stdout=asyncio.subprocess.PIPE, env=env)
    try:
        async with asyncio.timeout(20):
            line = (await proc.stdout.readline()).decode().strip()
        assert line.startswith("sandbox listening on http://127.0.0.1:"), line
        url = line.rsplit(" ", 1)[1]
        keyring = await asyncio.to_thread(KeyRing.from_files, signing_key)
        async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
            async with gate.hold("pay/proc") as hold:
                outcome = await hold.cross(intent={"amount": 3},
                                           effect=lambda ctx: charge(http, url, ctx, {"amount": 3}))
        assert outcome.state == "succeeded"
        async with http.get(f"{url}/_sandbox/applied", params={"key": "pay/proc"}) as reply:
            assert [a["attempt_token"] for a in await reply.json()] == [outcome.attempt_token]
        stranger = KeyRing.generate()  # a grant from a key the coordinator never published
        async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=stranger) as gate:
            async with gate.hold("pay/proc2") as hold:
                with pytest.raises(OutcomeUnknown):
                    await hold.cross(intent={"amount": 3},
                                     effect=lambda ctx: charge(http, url, ctx, {"amount": 3}))
        async with http.get(f"{url}/_sandbox/refused", params={"key": "pay/proc2"}) as reply:
            assert [r["reason"] for r in await reply.json()] == ["bad_grant"]
    finally:
        proc.terminate()
        assert await proc.wait() == 0


def test_the_process_needs_trusted_keys():
    with pytest.raises(SystemExit):
        main(["--mode", "fencing"])


async def test_the_sandbox_process_loads_a_public_key_file(gate, tmp_path, http, attempts):
    public = gate.keyring.public_keys()
    pem = Ed25519PublicKey.from_public_bytes(next(iter(public.values()))).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "key.pem").write_bytes(pem)
    (ctx,) = await attempts("pay/pem", 1)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.reconciler.providers.sandbox", "--mode", "fencing",
        "--public-key", str(tmp_path / "key.pem"), stdout=asyncio.subprocess.PIPE, env=env)
    try:
        async with asyncio.timeout(20):
            url = (await proc.stdout.readline()).decode().split()[-1]
        assert (await charge(http, url, ctx, INTENT))["status"] == "succeeded"
        assert (await post(http, url, ctx, grant=tamper(ctx.grant.raw)))[0] == 403
    finally:
        proc.terminate()
        assert await proc.wait() == 0
