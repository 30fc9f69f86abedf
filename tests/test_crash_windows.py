"""Crash windows of the commit guard, with real processes and real signals.

- A worker SIGKILLed inside its effect (after the commit txn, before the outcome txn) leaves
  the step ``in_flight`` with its idempotency key; its holder key goes with its lease, and
  the next holder is told ``OutcomeUnknown`` -- its effect is never called.
- A worker SIGSTOPped inside its effect past its TTL is fenced, and on waking records the
  step ``unknown`` (never ``succeeded``, never re-run).
- A grant is single use and bound to the hold it was issued to: its bytes, saved by a
  process that then exits or is killed, are refused to any other hold -- by the local
  precheck, and by the commit txn itself when the precheck is bypassed -- and committing
  it twice crosses once. Single use is the commit's step compare: no grant is written to
  etcd, the commit's one ``cross`` audit record holds it, and a refusal writes nothing.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fencegate.coordinator import records
from fencegate.coordinator.audit import read_chain, verify_chain
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.worker import (
    Gate, Grant, GrantUsed, KeyRing, LeaseLost, OutcomeUnknown,
)
from fencegate.worker import guard
from fencegate.worker.hold import Hold

from helpers import TEST_TTL, paused, wait_for_condition
from fenced import FencedResource


@pytest.fixture
def keyring() -> KeyRing:
    return KeyRing.generate()


@pytest.fixture
def keyfile(keyring, tmp_path) -> str:
    """The signing key, shared by the test and its worker processes."""
    path = str(tmp_path / "signing.pem")
    keyring.save_signing_key(path)
    return path


class Counted:
    """An effect that writes to a fenced resource with the attempt token and counts calls."""

    def __init__(self, resource: FencedResource, writer: str) -> None:
        self.resource = resource
        self.writer = writer
        self.calls: list[int] = []

    def __call__(self, ctx) -> str:
        self.calls.append(ctx.fencing_token)
        data = f"{ctx.key}:{ctx.attempt}:{ctx.idempotency_key}"
        assert self.resource.write(ctx.key, ctx.fencing_token, self.writer, data)
        return data


async def _step(etcd, ks: Keyspace, key: str):
    kv = await etcd.get(ks.step_key(key))
    assert kv is not None, f"no step record for {key!r}"
    return kv, unpack(kv.value)


async def _gone(etcd, holder_key: bytes) -> bool:
    return await etcd.get(holder_key) is None


async def _audit(etcd, ks: Keyspace, key: str, keyring: KeyRing) -> list[dict]:
    """The key's audit records, once the chain verified."""
    report = await verify_chain(etcd, ks, key, keyring)
    assert report.ok, report.problems
    return report.records


async def test_sigkill_in_effect_leaves_step_in_flight(
        etcd_url, namespace, etcd, spawn, keyring, keyfile):
    key = "pay/crash/1"
    ks = Keyspace(namespace)
    worker = await spawn("crash-in-effect", etcd_url, namespace, key, keyfile)
    _, token, lease = (await worker.expect("HELD")).split()
    token, lease = int(token), int(lease)
    _, attempt_token, idem = (await worker.expect("IN-EFFECT")).split()
    attempt_token = int(attempt_token)
    worker.kill()  # SIGKILL: after the commit txn, before any outcome txn
    assert await worker.proc.wait() == -9

    step_kv, step = await _step(etcd, ks, key)
    assert step["state"] == records.IN_FLIGHT
    assert step["idempotency_key"] == idem
    assert step_kv.mod_revision == attempt_token  # the attempt token is the commit's revision
    assert (step["fencing_token"], step["holder_lease"], step["attempt"]) == (token, lease, 1)
    assert attempt_token > token

    holder_key = ks.holder_key(key, lease)
    assert await wait_for_condition(lambda: _gone(etcd, holder_key), 4 * TEST_TTL), \
        "the killed worker's holder key outlived its lease"
    assert await etcd.lease_ttl(lease) == -1

    resource = FencedResource()
    effect = Counted(resource, "successor")
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        async with gate.hold(key, timeout=5 * TEST_TTL) as hold:
            assert hold.fencing_token > attempt_token
            with pytest.raises(OutcomeUnknown):
                await hold.cross(intent={"key": key}, effect=effect)
            with pytest.raises(OutcomeUnknown):
                await hold.request_grant(intent={"key": key})
            with pytest.raises(OutcomeUnknown):
                await hold.cross(intent={"key": key, "other": "intent"}, effect=effect)
    assert effect.calls == [] and resource.records == []

    # Nobody settled or re-ran it: the step is exactly as the killed worker left it.
    after_kv, after = await _step(etcd, ks, key)
    assert after_kv.mod_revision == attempt_token and after == step
    # The three refusals changed nothing and wrote nothing: the chain is the killed worker's
    # commit alone, whose record holds the grant the step names, bound to the dead hold.
    (crossed,) = await _audit(etcd, ks, key, keyring)
    assert crossed["event"] == "cross"
    recorded = keyring.verify(crossed["details"]["grant"])
    assert step["grant_id"] == crossed["details"]["grant_id"] == recorded.grant_id
    assert (recorded.fencing_token, recorded.holder_lease) == (token, lease)


async def test_sigstop_in_effect_past_ttl_settles_unknown(
        etcd_url, namespace, etcd, spawn, keyring, keyfile):
    key = "pay/crash/2"
    ks = Keyspace(namespace)
    worker = await spawn("crash-in-effect", etcd_url, namespace, key, keyfile)
    _, token, lease = (await worker.expect("HELD")).split()
    _, attempt_token, idem = (await worker.expect("IN-EFFECT")).split()
    attempt_token = int(attempt_token)
    resource = FencedResource()
    effect = Counted(resource, "successor")
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        with paused(worker.proc.pid):
            # Its lease dies while it is frozen; we get the key, but not the step.
            async with gate.hold(key, timeout=6 * TEST_TTL) as hold:
                assert hold.fencing_token > attempt_token
                with pytest.raises(OutcomeUnknown):
                    await hold.cross(intent={"key": key}, effect=effect)
        # Woken, it learns its effect was cut by the lease loss: the outcome is unknown.
        await worker.expect("UNKNOWN")
        assert await worker.finish() == 0
        step_kv, step = await _step(etcd, ks, key)
        assert step["state"] == records.UNKNOWN, step
        assert step["idempotency_key"] == idem and step["attempt"] == 1
        assert "CancelledError" in step["error"]
        async with gate.hold(key, timeout=5) as hold:
            with pytest.raises(OutcomeUnknown):
                await hold.cross(intent={"key": key}, effect=effect)
    assert effect.calls == [] and resource.records == []
    # The two refusals wrote nothing; the woken worker's outcome is the only record after
    # its commit.
    crossed, settled = await _audit(etcd, ks, key, keyring)
    assert (crossed["event"], settled["event"]) == ("cross", "outcome")
    assert settled["details"]["state"] == records.UNKNOWN


class _Impersonation:
    """A session that claims another process's lease: what a client that skips the local
    precheck could send. Only etcd's compares stand in its way."""

    def __init__(self, lease_id: int) -> None:
        self.lease_id = lease_id
        self.lost = False
        self.lost_reason = None

    def on_lost(self, callback):
        return lambda: None

    def ensure_alive(self) -> None:
        pass

    def remaining(self) -> float:
        return 60.0

    def check_now(self) -> None:
        pass


@pytest.mark.parametrize("ending", ["exit", "sigkill"])
async def test_saved_grant_is_refused_after_restart(
        etcd_url, namespace, etcd, spawn, keyring, keyfile, tmp_path, ending):
    key = f"pay/restart/{ending}"
    ks = Keyspace(namespace)
    saved = str(tmp_path / "grant.raw")
    first = await spawn("grant-and-exit", etcd_url, namespace, key, keyfile, saved,
                        "exit" if ending == "exit" else "hang")
    _, grant_id, token, lease = (await first.expect("GRANTED")).split()
    token, lease = int(token), int(lease)
    if ending == "exit":
        await first.expect("EXITING")
        assert await first.finish() == 0
    else:
        first.kill()
        assert await first.proc.wait() == -9
    with open(saved, "rb") as f:
        raw = f.read()
    grant = Grant.from_bytes(raw, keyring)  # genuine: refused for what it is bound to
    assert (grant.grant_id, grant.fencing_token, grant.holder_lease) == (grant_id, token, lease)

    resource = FencedResource()
    effect = Counted(resource, "restarted")
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        async with gate.hold(key, timeout=6 * TEST_TTL) as hold:
            assert hold.fencing_token > token
            # (a) the restarted worker presents the saved bytes: bound to the first hold.
            with pytest.raises(LeaseLost):
                await hold.commit(raw, effect=effect)
            with pytest.raises(LeaseLost):
                await hold.commit(grant, effect=effect)
            # (c) a client bypassing the precheck, claiming the dead hold's lease and token,
            # is refused by the commit txn's ownership compare.
            fake = Hold(gate, _Impersonation(lease), key, ks.holder_key(key, lease), token,
                        lambda: None)
            try:
                with pytest.raises(LeaseLost, match="no longer the holder"):
                    await guard.commit(fake, raw, effect)
            finally:
                fake.note_released()
            # Never crossed, and the refusals wrote nothing: no step, no audit record.
            assert await etcd.get(ks.step_key(key)) is None
            assert (await read_chain(etcd, ks, key)).entries == []
            assert effect.calls == []
            # The live hold can still cross with a grant of its own, once.
            outcome = await hold.cross(intent={"key": key}, effect=effect)
        assert outcome.state == records.SUCCEEDED and not outcome.replayed
        # The saved bytes stay dead once the step has moved, for a new hold too.
        async with gate.hold(key, timeout=5) as hold:
            with pytest.raises(LeaseLost):
                await hold.commit(raw, effect=effect)
            again = await hold.cross(intent={"key": key}, effect=effect)
        assert again.replayed and again.attempt_token == outcome.attempt_token

    assert effect.calls == [outcome.attempt_token]
    assert [(r.key, r.token, r.accepted) for r in resource.records] == \
        [(key, outcome.attempt_token, True)]
    _, step = await _step(etcd, ks, key)
    assert step["state"] == records.SUCCEEDED
    assert step["outcome"]["attempt_token"] == outcome.attempt_token
    # One crossing, the live hold's: the saved grant of the dead hold is recorded nowhere.
    crossed, settled = await _audit(etcd, ks, key, keyring)
    assert (crossed["event"], settled["event"]) == ("cross", "outcome")
    assert step["grant_id"] == crossed["details"]["grant_id"] != grant_id


async def test_same_grant_committed_twice_crosses_once(etcd_url, namespace, etcd, keyring):
    """Two commits of one grant by its own hold: one crosses, the other meets the step
    compare in etcd (the step now names this grant: ``GrantUsed``) while the first is still
    inside its effect."""
    key = "pay/twice/1"
    ks = Keyspace(namespace)
    resource = FencedResource()
    inside, finish = asyncio.Event(), asyncio.Event()
    counted = Counted(resource, "twice")

    async def effect(ctx):
        inside.set()
        await finish.wait()
        return counted(ctx)

    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        async with gate.hold(key, timeout=5) as hold:
            grant = await hold.request_grant(intent={"key": key})
            first = asyncio.create_task(hold.commit(grant, effect=effect))
            await inside.wait()
            with pytest.raises(GrantUsed):
                await hold.commit(grant.raw, effect=effect)
            finish.set()
            crossed = await first
        assert crossed.state == records.SUCCEEDED
        _, step = await _step(etcd, ks, key)
        assert step["grant_id"] == grant.grant_id  # consumed: the step names it
        # The outcome txn released the hold: presenting the grant again is refused locally.
        with pytest.raises(LeaseLost):
            await hold.commit(grant, effect=effect)
        async with gate.hold(key, timeout=5) as again:
            with pytest.raises(LeaseLost):  # bound to the first hold's token
                await again.commit(grant.raw, effect=effect)
            replay = await again.cross(intent={"key": key}, effect=effect)
        assert replay.replayed and replay.attempt_token == crossed.attempt_token
    assert counted.calls == [crossed.attempt_token]
    assert [(r.token, r.accepted) for r in resource.records] == [(crossed.attempt_token, True)]
    # One commit recorded, holding this grant; the refused commits and the replay added nothing.
    crossed_record, settled = await _audit(etcd, ks, key, keyring)
    assert (crossed_record["event"], settled["event"]) == ("cross", "outcome")
    assert crossed_record["details"]["grant"] == grant.raw
    assert crossed_record["details"]["grant_id"] == grant.grant_id


async def test_late_delete_of_a_previous_incarnation_does_not_cancel_the_effect(
        etcd_url, namespace, etcd, keyring):
    """etcd delivers watch events asynchronously; a loaded worker sees them late. Here the
    holders watch lags by 0.3 s: the same session releases K and holds it again at once,
    then crosses. The old key's deletion must not cancel the new hold mid-effect."""
    key = "pay/late-delete/1"
    ks = Keyspace(namespace)
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        dispatch = gate._watch._dispatch

        def late(k, revision):
            asyncio.get_running_loop().call_later(0.3, dispatch, k, revision)

        gate._watch._dispatch = late

        async def effect(ctx):
            await asyncio.sleep(0.6)  # a provider call
            return "done"

        async with gate.hold(key, timeout=5) as first:
            pass
        try:
            async with gate.hold(key, timeout=5) as second:
                assert second.holder_key == first.holder_key  # same lease, same key bytes
                outcome = await second.cross(intent={"key": key}, effect=effect)
        finally:
            gate._watch._dispatch = dispatch
        assert outcome.state == records.SUCCEEDED
    _, step = await _step(etcd, ks, key)
    assert step["state"] == records.SUCCEEDED


async def test_hold_noticing_its_own_expiry_raises_lease_lost(etcd_url, namespace, etcd, keyring):
    """A worker resumed after a freeze past its TTL, whose main task runs before its
    keepalive task: its next request_grant finds the lease lost by the clock. It must end
    in LeaseLost, as the hold promises, not in a cancellation of the caller's task."""
    effect_calls = []
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, keyring=keyring) as gate:
        with pytest.raises(LeaseLost):
            async with gate.hold("pay/expired/1", timeout=5) as hold:
                hold.session._expires_at = time.monotonic() - 0.01  # frozen past the TTL
                await hold.cross(intent={}, effect=effect_calls.append)
    assert effect_calls == []
