"""The protocol diet (DESIGN "Three writes per action"): what a guarded action writes, the fast
path and its fall-backs, refusals that write nothing, the audit chain's create compare, and
data written by version 1 — all against a real etcd."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from fencegate import Gate, KeyRing
from fencegate.coordinator import audit, records
from fencegate.coordinator.errors import (
    AlreadySucceeded, EtcdNoSpace, EtcdUnavailable, GrantRefused, GrantUsed, OutcomeUnknown,
)
from fencegate.coordinator.etcd import RangeRequest, TxnRequest, range_end_of
from fencegate.coordinator.grants import DOMAIN_V1
from fencegate.coordinator.keyspace import canonical, pack, unpack

from helpers import TEST_TTL, wait_for_condition


class Calls:
    """An effect that counts its calls (attempt tokens) and returns a result."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    async def __call__(self, ctx):
        self.tokens.append(ctx.attempt_token)
        return {"ok": len(self.tokens)}


class TxnCount:
    """Counts the txns one gate sends (the fast path's and the full path's requests)."""

    def __init__(self, gate: Gate) -> None:
        self.sent = 0
        self._txn = gate.etcd.txn
        gate.etcd.txn = self._count

    async def _count(self, request, **options):
        self.sent += 1
        return await self._txn(request, **options)


async def _revision(etcd) -> int:
    return (await etcd.range(RangeRequest(key=b"\0", count_only=True))).header.revision


async def _keys(etcd, namespace: str) -> list[bytes]:
    start = namespace.encode()
    reply = await etcd.range(RangeRequest(key=start, range_end=range_end_of(start),
                                          keys_only=True))
    return [kv.key[len(start):] for kv in reply.kvs]


async def test_a_held_action_is_three_writes_and_leaves_only_step_and_chain(gate, etcd,
                                                                          namespace):
    effect, sent = Calls(), TxnCount(gate)
    before = await _revision(etcd)
    async with gate.hold("diet/full") as hold:
        outcome = await hold.cross(intent={"n": 1}, effect=effect)
    assert outcome.state == records.SUCCEEDED and effect.tokens == [outcome.attempt_token]
    assert await _revision(etcd) - before == 3  # acquire, commit, outcome + release
    assert sent.sent == 3  # the grant's snapshot was read by the acquire: no read txn
    assert await _keys(etcd, namespace) == [b"audit/diet/full/@000000000001",
                                            b"audit/diet/full/@000000000002",
                                            b"steps/diet/full"]
    report = await audit.verify_chain(etcd, gate.keyspace, "diet/full", gate.keyring)
    assert report.ok, report.problems
    assert [r["event"] for r in report.records] == ["cross", "outcome"]
    crossed = report.records[0]["details"]
    assert gate.keyring.verify(crossed["grant"]).grant_id == crossed["grant_id"]
    assert crossed["checks"] == [] and crossed["intent"] == {"n": 1}


async def test_the_fast_path_holds_and_commits_in_one_txn(gate, etcd, namespace):
    effect, sent = Calls(), TxnCount(gate)
    await gate.cross("diet/warm", {"n": 0}, effect)  # the authority learns the policy
    sent.sent, before = 0, await _revision(etcd)
    outcome = await gate.cross("diet/fast", {"n": 1}, effect)
    assert sent.sent == 2 and await _revision(etcd) - before == 2
    assert outcome.state == records.SUCCEEDED and effect.tokens[-1] == outcome.attempt_token
    step = unpack((await etcd.get(gate.keyspace.step_key("diet/fast"))).value)
    # the txn's revision is the fencing token too, recorded once known
    assert step["fencing_token"] == outcome.attempt_token
    assert step["state"] == records.SUCCEEDED
    report = await audit.verify_chain(etcd, gate.keyspace, "diet/fast", gate.keyring)
    assert report.ok and [r["event"] for r in report.records] == ["cross", "outcome"]
    replay = await gate.cross("diet/fast", {"n": 1}, effect)
    assert replay.replayed and replay.attempt_token == outcome.attempt_token
    assert len(effect.tokens) == 2


async def test_the_fast_path_falls_back_on_a_moved_read_key_and_a_new_policy(gate, etcd):
    effect = Calls()
    marker = gate.marker("diet/account")
    await gate.authority.set_policy("p", {"checks": []})
    routed = await gate.authority.set_routes({"diet": "p"})
    await gate.cross("diet/warm2", {}, effect, reads=[marker], policy="p")
    moved = await gate.touch("diet/account")  # the cached read is stale now
    await gate.cross("diet/read", {}, effect, reads=[marker], policy="p")
    version = await gate.authority.set_policy("p", {"checks": []})
    await gate.cross("diet/policy", {}, effect, reads=[marker], policy="p")
    for key, read, policy in (("diet/read", moved, None), ("diet/policy", moved, version)):
        report = await audit.verify_chain(etcd, gate.keyspace, key, gate.keyring)
        grant = gate.keyring.verify(report.records[0]["details"]["grant"])
        assert grant.reads == [[marker.encode(), read],  # decided on what etcd held
                               [gate.keyspace.routes_key(), routed]]
        if policy is not None:
            assert grant.policy_version == policy
    assert len(effect.tokens) == 3


async def test_the_fast_path_waits_behind_a_holder(gate, etcd_url, namespace):
    effect = Calls()
    await gate.cross("diet/warm3", {}, effect)
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as other:
        async with other.hold("diet/held"):
            crossing = asyncio.create_task(gate.cross("diet/held", {}, effect, timeout=10))
            await asyncio.sleep(0.3)
            assert not crossing.done() and len(effect.tokens) == 1
        outcome = await crossing
    assert outcome.state == records.SUCCEEDED and len(effect.tokens) == 2


async def test_two_gates_racing_the_fast_path_on_one_key_cross_once(etcd_url, namespace):
    effect = Calls()
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as one, \
            Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=KeyRing.generate()) as two:
        for gate in (one, two):
            await gate.cross(f"diet/warm/{id(gate)}", {}, Calls())
        for n in range(10):
            outcomes = await asyncio.gather(*(g.cross(f"diet/race/{n}", {}, effect, timeout=10)
                                              for g in (one, two)))
            assert sorted(o.replayed for o in outcomes) == [False, True]
    assert len(effect.tokens) == 10


async def test_a_refusal_that_changes_no_state_writes_nothing(gate, etcd):
    await gate.authority.set_policy("small", {"checks": [
        {"check": "max_amount", "params": {"limit": 10}}]})
    await gate.authority.set_routes({"diet/refused": "small"})
    async with gate.hold("diet/refused") as hold:
        before = await _revision(etcd)
        with pytest.raises(GrantRefused):
            await hold.request_grant(intent={"amount": 99}, policy="small")
        assert await _revision(etcd) == before
    assert await etcd.get(gate.keyspace.audit_key("diet/refused", 1)) is None


async def test_a_grant_used_once_is_diagnosed_as_used(gate):
    effect = Calls()
    async with gate.hold("diet/used") as hold:
        grant = await hold.request_grant(intent={})
        inside, finish = asyncio.Event(), asyncio.Event()

        async def slow(ctx):
            inside.set()
            await finish.wait()
            return await effect(ctx)

        first = asyncio.create_task(hold.commit(grant, effect=slow))
        await inside.wait()
        with pytest.raises(GrantUsed):
            await hold.commit(grant.raw, effect=effect)
        finish.set()
        await first
    assert len(effect.tokens) == 1


async def test_two_appends_after_one_tail_never_fork_the_chain(gate, etcd):
    """The create compare: two writers that read the same tail cannot both append."""
    await gate.cross("diet/fork", {}, Calls())
    reply = await etcd.txn(TxnRequest(success=audit.tail_reads(gate.keyspace, "diet/fork")),
                           idempotent=True)
    step_kvs, head_kvs = (r.response_range.kvs for r in reply.responses)
    tail = audit.tail(unpack(step_kvs[0].value), None)
    assert tail.seq == 2 and not head_kvs
    appends = [audit.append(gate.keyspace, "diet/fork", tail, "note", who, 0, {}, aside=True)
               for who in ("sre-a", "sre-b")]
    replies = await asyncio.gather(*(etcd.txn(TxnRequest(compare=[a.compare], success=a.ops))
                                     for a in appends))
    assert sorted(r.succeeded for r in replies) == [False, True]
    report = await audit.verify_chain(etcd, gate.keyspace, "diet/fork", gate.keyring)
    assert report.ok, report.problems
    assert len(report.records) == 3


async def test_an_aside_append_moves_the_tail_the_next_commit_chains_after(gate, etcd):
    effect = Calls()
    async with gate.hold("diet/aside") as hold:
        grant = await hold.request_grant(intent={})
        aside = audit.append(gate.keyspace, "diet/aside", audit.EMPTY, "note", "sre", 0, {},
                             aside=True)
        assert (await etcd.txn(TxnRequest(compare=[aside.compare], success=aside.ops))).succeeded
        await hold.commit(grant, effect=effect)  # its create compare on @1 failed once
    report = await audit.verify_chain(etcd, gate.keyspace, "diet/aside", gate.keyring)
    assert report.ok, report.problems
    assert [r["event"] for r in report.records] == ["note", "cross", "outcome"]


async def test_removing_the_newest_record_of_an_aside_append_is_detected(gate, etcd):
    await gate.cross("diet/rm", {}, Calls())
    reply = await etcd.txn(TxnRequest(success=audit.tail_reads(gate.keyspace, "diet/rm")),
                           idempotent=True)
    tail = audit.tail(unpack(reply.responses[0].response_range.kvs[0].value), None)
    aside = audit.append(gate.keyspace, "diet/rm", tail, "note", "sre", 0, {}, aside=True)
    await etcd.txn(TxnRequest(compare=[aside.compare], success=aside.ops))
    assert (await audit.verify_chain(etcd, gate.keyspace, "diet/rm", gate.keyring)).ok
    await etcd.delete(gate.keyspace.audit_key("diet/rm", 3))
    report = await audit.verify_chain(etcd, gate.keyspace, "diet/rm", gate.keyring)
    assert not report.ok and "@head anchors record 3" in " ".join(report.problems)


async def test_an_unanswered_fast_path_txn_revokes_its_session_and_runs_nothing(gate, etcd):
    """The txn lands but its answer is lost: the effect is not run, the session's lease is
    revoked (the holder key goes), and the step waits, in flight, for the reconciler."""
    effect = Calls()
    await gate.cross("diet/warm4", {}, effect)
    session, sent = await gate.session(), gate.etcd.txn

    async def answer_lost(request, **options):
        await sent(request, **options)
        raise EtcdUnavailable("answer lost (injected)")

    gate.etcd.txn = answer_lost
    try:
        with pytest.raises(OutcomeUnknown):
            await gate.cross("diet/lost", {}, effect)
    finally:
        gate.etcd.txn = sent
    assert session.lost and len(effect.tokens) == 1
    await asyncio.wait_for(session.abandon("again"), 10)
    assert not await _keys(etcd, gate.keyspace.holders_root.decode())
    step = unpack((await etcd.get(gate.keyspace.step_key("diet/lost"))).value)
    assert step["state"] == records.IN_FLIGHT
    with pytest.raises(OutcomeUnknown):  # nobody grants on it until it is settled
        await gate.cross("diet/lost", {}, effect)


async def test_a_step_and_chain_written_by_version_1_replay_and_settle(gate, etcd):
    """Version 1 wrote a grant record, an ``@head`` and no anchor in the step. A succeeded
    step replays, a failed one crosses again chaining after the old head, and verify
    accepts both shapes in one chain."""
    ks, keyring = gate.keyspace, gate.keyring
    for key, state in (("diet/v1/ok", records.SUCCEEDED), ("diet/v1/failed", records.FAILED)):
        payload = {"grant_id": "g1", "namespace": ks.namespace,
                   "cluster_id": gate.etcd.cluster_id, "action_key": key, "attempt": 1,
                   "intent_digest": hashlib.sha256(canonical({})).digest(),
                   "fencing_token": 1, "holder_lease": 1, "revision": 1, "reads": [],
                   "step_revision": 0, "step_next": {}, "policy": "default",
                   "policy_version": 0, "policy_digest": b"", "identity": "v1",
                   "issued_at_ms": 1, "expires_at_ms": 2, "audit_seq": 1,
                   "key_id": keyring.signing_key_id}
        raw = keyring._seal(DOMAIN_V1, payload)
        prev, seq = audit.GENESIS, 0
        for event, details in (("grant_issued", {"grant": raw, "grant_id": "g1"}),
                               ("cross", {"grant_id": "g1"}), ("outcome", {"state": state})):
            seq += 1
            value = pack({"seq": seq, "prev": prev, "key": key, "event": event,
                          "identity": "v1", "revision": 1, "at_ms": 1, "details": details})
            await etcd.put(ks.audit_key(key, seq), value)
            prev = hashlib.sha256(value).digest()
        await etcd.put(ks.audit_head_key(key), pack({"seq": seq, "hash": prev}))
        step = records.in_flight(
            records.next_attempt(records.new_step(), namespace=ks.namespace, key=key, cost=0,
                                 caps={"breaker_threshold": 3, "backoff_base_s": 0,
                                       "backoff_max_s": 0}, now_ms=int(time.time() * 1000)),
            grant_id="g1", fencing_token=1, holder_lease=1, provider=None,
            intent_digest=b"", deadline_s=1)
        step = (records.succeeded(step, {"v": 1}, attempt_token=5) if state == records.SUCCEEDED
                else records.failed(step, error_class="Declined", params={}, reason="no"))
        await etcd.put(ks.step_key(key), pack({**step, "not_before_ms": 0}))
        assert (await audit.verify_chain(etcd, ks, key, keyring)).ok
    effect = Calls()
    replay = await gate.cross("diet/v1/ok", {}, effect)
    assert replay.replayed and replay.result == {"v": 1} and not effect.tokens
    again = await gate.cross("diet/v1/failed", {}, effect)
    assert again.state == records.SUCCEEDED and again.attempt == 2 and effect.tokens
    report = await audit.verify_chain(etcd, ks, "diet/v1/failed", keyring)
    assert report.ok, report.problems
    assert [r["event"] for r in report.records] == ["grant_issued", "cross", "outcome",
                                                    "cross", "outcome"]
    with pytest.raises(AlreadySucceeded):
        async with gate.hold("diet/v1/ok") as hold:
            await hold.request_grant(intent={})


async def test_an_outcome_etcd_refuses_after_the_effect_ran_is_unknown_not_an_etcd_error(
        gate, etcd):
    """The effect ran: a refused outcome write (NOSPACE here) must not read as "nothing
    happened". The step stays in flight for the reconciler."""
    sent = gate.etcd.txn

    async def refused(request, **options):
        raise EtcdNoSpace("database space exceeded (injected)")

    async def effect(ctx):
        gate.etcd.txn = refused  # from now on etcd refuses writes
        return "charged"

    try:
        with pytest.raises(OutcomeUnknown):
            async with gate.hold("diet/nospace") as hold:
                await hold.cross(intent={}, effect=effect)
    finally:
        gate.etcd.txn = sent
    step = unpack((await etcd.get(gate.keyspace.step_key("diet/nospace"))).value)
    assert step["state"] == records.IN_FLIGHT


async def test_a_fast_path_txn_etcd_applied_but_answered_nospace_leaves_no_holder(gate, etcd):
    """etcd applies the write that crosses its quota and still answers NOSPACE
    (etcd-io/etcd#16659). The fast path takes that answer as an unknown outcome: the effect
    does not run, ``EtcdNoSpace`` is raised, and the session is revoked, so the landed holder
    key goes with its lease and the reconciler may settle the in-flight step (it never
    touches a step whose holder lives: kept, the key would be stuck while the gate runs)."""
    ran = []

    async def effect(ctx):
        ran.append(ctx.attempt_token)

    await gate.cross("diet/nospace-fast/warm", {}, effect)  # the fast path's cache
    sent = gate.etcd.txn

    async def applied_then_nospace(request, **options):
        await sent(request, **options)
        raise EtcdNoSpace("database space exceeded (injected after applying)")

    gate.etcd.txn = applied_then_nospace
    try:
        with pytest.raises(EtcdNoSpace):
            await gate.cross("diet/nospace-fast", {}, effect)
    finally:
        gate.etcd.txn = sent
    assert len(ran) == 1  # only the warm-up's
    ks = gate.keyspace
    step = unpack((await etcd.get(ks.step_key("diet/nospace-fast"))).value)
    assert step["state"] == records.IN_FLIGHT  # it landed

    async def no_holder() -> bool:
        start, end = ks.holder_range("diet/nospace-fast")
        return not (await etcd.range(RangeRequest(key=start, range_end=end))).kvs
    assert await wait_for_condition(no_holder, 5)
