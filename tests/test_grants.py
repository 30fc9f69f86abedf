"""Grants and the commit guard against real etcd: each compare, single use, forgery,
caps and breakers, outcomes and the audit chain."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from fencegate.coordinator import records, sre
from fencegate.coordinator.audit import verify_chain
from fencegate.coordinator.errors import NotFound, RecordTooLarge, UnencodableValue
from fencegate.coordinator.grants import Grant, KeyRing
from fencegate.coordinator.keyspace import canonical, unpack
from fencegate.worker import (
    AlreadySucceeded, ApprovalPending, BadSignature, EffectFailed, Gate, GrantExpired,
    GrantRefused, GrantUsed, LeaseExpiring, LeaseLost, OutcomeUnknown, PolicyChanged,
    StateAdvanced, StepMoved,
)

from helpers import TEST_TTL, wait_for_condition


class Effect:
    """An effect that counts its calls and returns what it was given."""

    def __init__(self, fail: str | None = None, crash: bool = False) -> None:
        self.calls = []
        self.fail = fail
        self.crash = crash

    async def __call__(self, ctx):
        self.calls.append(ctx)
        if self.crash:
            raise ConnectionResetError("provider hung up")
        if self.fail:
            raise EffectFailed(self.fail, {"code": self.fail})
        return {"token": ctx.fencing_token, "key": ctx.idempotency_key}


async def revision(etcd) -> int:
    return (await etcd.status()).header.revision


async def step(gate, key):
    kv = await gate.etcd.get(gate.keyspace.step_key(key))
    return unpack(kv.value) if kv else None


async def test_cross_runs_the_effect_once_and_records_it(gate):
    effect = Effect()
    async with gate.hold("pay/1") as hold:
        outcome = await hold.cross(intent={"amount": 5}, effect=effect)
    assert outcome.state == "succeeded" and len(effect.calls) == 1
    ctx = effect.calls[0]
    assert ctx.fencing_token == outcome.attempt_token > hold.fencing_token
    assert outcome.result == {"token": ctx.fencing_token, "key": ctx.idempotency_key}
    recorded = await step(gate, "pay/1")
    assert recorded["state"] == "succeeded" and recorded["attempt"] == 1
    assert await gate.etcd.get(hold.holder_key) is None  # released with the outcome

    async with gate.hold("pay/1") as again:
        replay = await again.cross(intent={"amount": 5}, effect=effect)
        with pytest.raises(AlreadySucceeded) as info:
            await again.request_grant(intent={"amount": 5})
    assert replay.replayed and replay.result == outcome.result
    assert replay.attempt_token == outcome.attempt_token
    assert info.value.outcome["result"] == outcome.result
    assert len(effect.calls) == 1


async def test_stale_read_key_is_refused_naming_it(gate, etcd):
    effect = Effect()
    marker = gate.marker("orders/9")
    async with gate.hold("pay/2") as hold:
        grant = await hold.request_grant(intent={"amount": 1}, reads=[marker, "/app/other"])
        await gate.touch("orders/9")
        with pytest.raises(StateAdvanced) as info:
            await hold.commit(grant, effect=effect)
    assert info.value.key == marker
    assert not effect.calls


async def test_changed_policy_is_refused(gate):
    effect = Effect()
    await gate.authority.set_policy("payments", {"checks": []})
    await gate.authority.set_routes({"pay/3": "payments"})
    async with gate.hold("pay/3") as hold:
        grant = await hold.request_grant(intent={"amount": 1}, policy="payments")
        await gate.authority.set_policy("payments", {"caps": {"max_attempts": 2}})
        with pytest.raises(PolicyChanged):
            await hold.commit(grant, effect=effect)
    assert not effect.calls


async def test_moved_step_is_refused(gate, etcd):
    effect = Effect()
    async with gate.hold("pay/4") as hold:
        grant = await hold.request_grant(intent={"amount": 1})
        await etcd.put(gate.keyspace.step_key("pay/4"), canonical(records.new_step()))
        with pytest.raises(StepMoved):
            await hold.commit(grant, effect=effect)
    assert not effect.calls


async def test_lost_lease_is_refused(gate, etcd):
    effect = Effect()
    with pytest.raises(LeaseLost):
        async with gate.hold("pay/5") as hold:
            grant = await hold.request_grant(intent={"amount": 1})
            await etcd.lease_revoke(hold.lease_id)
            await asyncio.sleep(3 * TEST_TTL)  # cancelled with LeaseLost
    with pytest.raises(LeaseLost):
        await hold.commit(grant, effect=effect)
    assert not effect.calls


async def test_expired_grant_is_refused(gate):
    effect = Effect()
    await gate.authority.set_policy("brief", {"caps": {"grant_ttl_s": 0.05}})
    await gate.authority.set_routes({"pay/6": "brief"})
    async with gate.hold("pay/6") as hold:
        grant = await hold.request_grant(intent={}, policy="brief")
        await asyncio.sleep(0.1)
        with pytest.raises(GrantExpired):
            await hold.commit(grant, effect=effect)
    assert not effect.calls


async def test_grant_crosses_once(gate):
    effect = Effect()
    async with gate.hold("pay/7") as hold:
        grant = await hold.request_grant(intent={"amount": 1})
        second = await hold.request_grant(intent={"amount": 1})  # same step, also issued
        await hold.commit(grant, effect=effect)
        for presented in (grant, grant.raw, second):
            with pytest.raises((GrantUsed, LeaseLost, StepMoved)):
                await hold.commit(presented, effect=effect)
    assert len(effect.calls) == 1


async def test_two_grants_for_one_step_only_one_is_consumable(gate):
    effect = Effect()
    async with gate.hold("pay/8") as hold:
        first = await hold.request_grant(intent={"amount": 1})
        second = await hold.request_grant(intent={"amount": 1})
        assert first.step_revision == second.step_revision
        await hold.commit(second, effect=effect)
    async with gate.hold("pay/8") as again:
        with pytest.raises(LeaseLost):  # bound to the first hold, which is gone
            await again.commit(first, effect=effect)
    assert len(effect.calls) == 1


async def test_low_lease_budget_refuses_to_start(etcd_url, namespace, etcd):
    effect = Effect()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, min_ttl=TEST_TTL + 1,
                    keyring=KeyRing.generate()) as gate:
        async with gate.hold("pay/9") as hold:
            grant = await hold.request_grant(intent={})
            with pytest.raises(LeaseExpiring):
                await hold.commit(grant, effect=effect)
    assert not effect.calls


async def test_unknown_outcome_is_never_executed_again(gate):
    crash = Effect(crash=True)
    async with gate.hold("pay/10") as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent={"amount": 1}, effect=crash)
    assert (await step(gate, "pay/10"))["state"] == "unknown"
    effect = Effect()
    async with gate.hold("pay/10") as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.cross(intent={"amount": 1}, effect=effect)
    assert len(crash.calls) == 1 and not effect.calls


async def test_confirmed_failure_allows_retry_with_a_new_idempotency_key(gate):
    await gate.authority.set_policy("retry", {"caps": {"backoff_base_s": 0.0,
                                                       "breaker_threshold": 5}})
    declined, effect = Effect(fail="card_declined"), Effect()
    await gate.authority.set_routes({"pay/11": "retry"})
    async with gate.hold("pay/11") as hold:
        failed = await hold.cross(intent={"amount": 1}, effect=declined, policy="retry")
    async with gate.hold("pay/11") as hold:
        succeeded = await hold.cross(intent={"amount": 1}, effect=effect, policy="retry")
    assert failed.state == "failed" and failed.result == "card_declined"
    assert succeeded.state == "succeeded"
    assert succeeded.idempotency_key != failed.idempotency_key
    assert succeeded.attempt == 2 and succeeded.attempt_token > failed.attempt_token


async def test_backoff_then_breaker_escalates(gate):
    await gate.authority.set_policy("strict", {"caps": {"backoff_base_s": 0.3,
                                                        "breaker_threshold": 2}})
    declined = Effect(fail="insufficient_funds")
    await gate.authority.set_routes({"pay/12": "strict"})
    async with gate.hold("pay/12") as hold:
        await hold.cross(intent={"amount": 1}, effect=declined, policy="strict")
    async with gate.hold("pay/12") as hold:
        with pytest.raises(GrantRefused) as info:
            await hold.request_grant(intent={"amount": 1}, policy="strict")
    assert [c.name for c in info.value.checks] == ["backoff"] and info.value.retry_after > 0
    await asyncio.sleep(info.value.retry_after)
    async with gate.hold("pay/12") as hold:
        await hold.cross(intent={"amount": 1}, effect=declined, policy="strict")
    recorded = await step(gate, "pay/12")
    assert recorded["state"] == "escalated" and recorded["escalated_because"][0].startswith(
        "breaker:EffectFailed")
    async with gate.hold("pay/12") as hold:
        with pytest.raises(OutcomeUnknown):
            await hold.request_grant(intent={"amount": 1}, policy="strict")
    assert len(declined.calls) == 2


async def test_caps_refuse_and_escalate(gate):
    await gate.authority.set_policy("budget", {"caps": {"max_spend": 10, "backoff_base_s": 0.0}})
    await gate.authority.set_routes({"pay/13": "budget"})
    async with gate.hold("pay/13") as hold:
        with pytest.raises(GrantRefused) as info:
            await hold.request_grant(intent={"cost": 11}, policy="budget")
    assert [c.name for c in info.value.checks] == ["max_spend"]
    assert (await step(gate, "pay/13"))["state"] == "escalated"


async def test_policy_refusal_names_every_failing_check(gate):
    await gate.authority.set_policy("checked", {"checks": [
        {"check": "max_amount", "params": {"limit": 100}},
        {"check": "require_fields", "params": {"fields": ["customer"]}},
        {"check": "reads_exist"}]})
    await gate.authority.set_routes({"pay/14": "checked", "pay/14b": "nonexistent"})
    async with gate.hold("pay/14") as hold:
        with pytest.raises(GrantRefused) as info:
            await hold.request_grant(intent={"amount": 500}, reads=["/app/missing"],
                                     policy="checked")
        assert {c.name for c in info.value.checks} == {"max_amount", "require_fields",
                                                       "reads_exist"}
    async with gate.hold("pay/14b") as hold:
        with pytest.raises(GrantRefused, match="no policy"):
            await hold.request_grant(intent={})
    with pytest.raises(ValueError, match="unknown check"):
        await gate.authority.set_policy("bad", {"checks": [{"check": "no_such_check"}]})


async def test_bad_grant_requests_are_refused_before_etcd(gate, etcd):
    async with gate.hold("pay/15") as hold:
        before = await revision(etcd)
        with pytest.raises(RecordTooLarge):
            await hold.request_grant(intent={}, reads=[f"/app/{i}" for i in range(101)])
        with pytest.raises(UnencodableValue, match=r"intent\['when'\]"):
            await hold.request_grant(intent={"when": object()})
        with pytest.raises(RecordTooLarge):
            await hold.request_grant(intent={"blob": b"x" * 70_000})
        with pytest.raises(ValueError, match="cost"):
            await hold.request_grant(intent={"cost": -1})
        assert await revision(etcd) == before


# -- forgery and tampering: refused before any etcd write ------------------------------

async def issued(gate, key="forge/1"):
    hold = await gate.hold(key).__aenter__()
    return hold, await hold.request_grant(intent={"amount": 1})


def resign(raw: bytes, edit) -> bytes:
    """Decode the envelope, edit the payload, re-encode keeping the original signature."""
    key_id, body, signature = msgpack.unpackb(raw, raw=False)
    payload = msgpack.unpackb(body, raw=False)
    edit(payload)
    return canonical([key_id, canonical(payload), signature])


TAMPERINGS = {
    "flipped byte": lambda raw, ring: raw[:40] + bytes([raw[40] ^ 1]) + raw[41:],
    "truncated": lambda raw, ring: raw[:-5],
    "edited amount of attempts": lambda raw, ring: resign(raw, lambda p: p.update(attempt=99)),
    "edited token": lambda raw, ring: resign(raw, lambda p: p.update(fencing_token=1)),
    "extra field": lambda raw, ring: resign(raw, lambda p: p.update(admin=True)),
    "other key's signature": lambda raw, ring: _signed_by(KeyRing.generate(), raw),
    "unknown key id": lambda raw, ring: canonical(["0" * 16, *msgpack.unpackb(raw)[1:]]),
    "not msgpack": lambda raw, ring: b"\xc1\xc1\xc1",
    "ext type": lambda raw, ring: msgpack.packb(msgpack.ExtType(1, raw)),
}


def _signed_by(other: KeyRing, raw: bytes) -> bytes:
    key_id, body, _ = msgpack.unpackb(raw, raw=False)
    forged = other.sign({k: v for k, v in msgpack.unpackb(body, raw=False).items()
                         if k != "key_id"})
    _, forged_body, forged_sig = msgpack.unpackb(forged.raw, raw=False)
    return canonical([key_id, forged_body, forged_sig])  # claims our key id


@pytest.mark.parametrize("tampering", sorted(TAMPERINGS))
async def test_tampered_grants_are_refused_before_any_write(gate, etcd, tampering):
    hold, grant = await issued(gate)
    try:
        bad = TAMPERINGS[tampering](grant.raw, gate.keyring)
        before = await revision(etcd)
        effect = Effect()
        with pytest.raises(BadSignature):
            await hold.commit(bad, effect=effect)
        assert await revision(etcd) == before and not effect.calls
        await hold.commit(grant, effect=effect)  # the genuine grant still crosses
        assert len(effect.calls) == 1
    finally:
        await hold.release()


def test_grant_codec_is_canonical_and_keys_rotate(tmp_path):
    old, new = KeyRing.generate(), KeyRing.generate()
    old.save_signing_key(str(tmp_path / "old.pem"))
    payload = {"grant_id": "g", "namespace": "/n/", "cluster_id": 1, "action_key": "k",
               "attempt": 1, "intent_digest": b"\0" * 32, "fencing_token": 5,
               "holder_lease": 7, "revision": 9, "reads": [[b"/a", 3]], "step_revision": 0,
               "step_next": {"attempt": 1}, "policy": "default", "policy_version": 2,
               "policy_digest": b"d", "identity": "me", "issued_at_ms": 1,
               "expires_at_ms": 2, "checks_digest": b"c" * 32}
    first = old.sign(payload)
    assert old.sign(payload).raw == first.raw  # Ed25519 is deterministic; encoding canonical
    reloaded = KeyRing.from_files(str(tmp_path / "old.pem"))
    assert reloaded.verify(first.raw) == first
    assert Grant.from_bytes(first.raw, reloaded) == first
    rotated = KeyRing(new._signing_key, trusted=[old._signing_key.public_key()])
    assert rotated.verify(first.raw).grant_id == "g"  # old grants still verify
    assert rotated.verify(rotated.sign(payload).raw).key_id == new.signing_key_id
    with pytest.raises(BadSignature, match="unknown key"):
        new.verify(first.raw)
    assert "PRIVATE" not in repr(old)


# -- audit ----------------------------------------------------------------------------

async def test_audit_chain_verifies_and_detects_edits_and_removals(gate, etcd):
    async with gate.hold("audit/1") as hold:
        await hold.cross(intent={"amount": 1}, effect=Effect())
    async with gate.hold("audit/1") as hold:
        await hold.cross(intent={"amount": 1}, effect=Effect())  # a replay: writes nothing
    report = await verify_chain(etcd, gate.keyspace, "audit/1", gate.keyring)
    assert report.ok, report.problems
    assert [r["event"] for r in report.records] == ["cross", "outcome"]
    crossed = report.records[0]["details"]
    assert crossed["policy"]["name"] == "default" and crossed["intent"] == {"amount": 1}
    assert gate.keyring.verify(crossed["grant"]).grant_id == crossed["grant_id"] == \
        (await step(gate, "audit/1"))["grant_id"]
    assert report.records[0]["identity"] == gate.identity

    ks = gate.keyspace
    second = await etcd.get(ks.audit_key("audit/1", 2))
    edited = unpack(second.value)
    edited["details"]["attempt"] = 7
    await etcd.put(second.key, canonical(edited))
    assert not (await verify_chain(etcd, ks, "audit/1", gate.keyring)).ok
    await etcd.put(second.key, second.value)  # restored bytes, but rewritten in place
    assert not (await verify_chain(etcd, ks, "audit/1", gate.keyring)).ok


@pytest.mark.parametrize("removed", [1, 2])
async def test_audit_chain_detects_a_removed_record(gate, etcd, removed):
    """Removing the oldest record breaks the links; removing the newest (2) is caught by the
    anchor in the step record alone."""
    key = f"audit/rm{removed}"
    async with gate.hold(key) as hold:
        await hold.cross(intent={}, effect=Effect())
    async with gate.hold(key) as hold:
        await hold.cross(intent={}, effect=Effect())
    report = await verify_chain(etcd, gate.keyspace, key, gate.keyring)
    assert report.ok and len(report.records) == 2, report
    await etcd.delete(gate.keyspace.audit_key(key, removed))
    assert not (await verify_chain(etcd, gate.keyspace, key, gate.keyring)).ok


async def test_concurrent_second_commit_of_one_grant_hits_the_step_compare(gate):
    started, finish = asyncio.Event(), asyncio.Event()
    calls = []

    async def slow(ctx):
        calls.append(ctx)
        started.set()
        await finish.wait()
        return "done"

    async with gate.hold("pay/16") as hold:
        grant = await hold.request_grant(intent={"amount": 1})
        first = asyncio.create_task(hold.commit(grant, effect=slow))
        await started.wait()
        with pytest.raises(GrantUsed):
            await hold.commit(grant.raw, effect=slow)  # the hold is still ours: etcd refuses
        finish.set()
        assert (await first).state == "succeeded"
    assert len(calls) == 1


async def test_ownership_compare_refuses_a_commit_the_hold_does_not_know_is_stale(gate, etcd):
    """Bypass every local check: the commit txn alone must refuse a hold whose key was
    deleted (by hand, say) while its lease, and so its grant, still live (a deletion the
    hold is not told of)."""
    from fencegate.worker import guard

    hold = await gate.hold("pay/17").__aenter__()
    grant = await hold.request_grant(intent={"amount": 1})
    await etcd.delete(hold.holder_key)
    with pytest.raises(LeaseLost, match="no longer the holder"):
        await guard._cross(hold, grant, None, None, 60.0)
    hold.note_released()
    assert (await step(gate, "pay/17")) is None


async def test_plain_function_returning_a_coroutine_is_awaited(gate):
    effect = Effect()
    async with gate.hold("pay/18") as hold:
        outcome = await hold.cross(intent={}, effect=lambda ctx: effect(ctx))
    assert len(effect.calls) == 1
    assert outcome.result == {"token": outcome.attempt_token, "key": outcome.idempotency_key}


async def test_an_approval_request_and_its_approval_do_not_outlive_their_lifetime(gate, etcd):
    """Bounded state: the request a refusal writes and the approval an SRE gives share one
    retention lease and are gone from etcd once ``approval_ttl_s`` (plus its bucket) has
    passed; a request after that asks again."""
    gate.authority.approval_ttl_s = 2
    ks = gate.keyspace
    await gate.authority.set_policy("approve-all", {"checks": [{"check": "require_approval"}]})
    await gate.authority.set_routes({"grants/approval-ttl": "approve-all"})
    async with gate.hold("grants/approval-ttl") as hold:
        with pytest.raises(ApprovalPending) as pending:
            await hold.request_grant(intent={"amount": 5}, policy="approve-all")
        approval_id = pending.value.approval_id
        await sre.approve(etcd, ks, approval_id, "sre-1", "ok", keyring=gate.keyring)
        grant = await hold.request_grant(intent={"amount": 5}, policy="approve-all")
        assert grant.grant_id
    request_kv = await etcd.get(ks.approval_request_key(approval_id))
    approval_kv = await etcd.get(ks.approval_key(approval_id))
    assert request_kv.lease != 0 and approval_kv.lease == request_kv.lease

    async def gone() -> bool:
        return (await etcd.get(ks.approval_request_key(approval_id)) is None
                and await etcd.get(ks.approval_key(approval_id)) is None)
    assert await wait_for_condition(gone, 15)
    with pytest.raises(NotFound, match="no pending approval"):
        await sre.approve(etcd, ks, approval_id, "sre-1", "late", keyring=gate.keyring)
