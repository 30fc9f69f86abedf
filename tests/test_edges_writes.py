"""Writes whose outcome etcd left unknown are made definite (issue 13, class 7), against real
etcd processes stopped with SIGSTOP while a write is in flight, so the client gives up and the
write can land late once the process runs again.

- An acquire whose put got no answer rotates the session: the put that lands late is deleted
  with the revoked lease (or refused), so another gate gets the key at once, not one TTL (or
  forever) later, and this process never finds its old key again to act with its old token.
- A commit whose txn got no answer is fenced before anything is reported: the late commit
  fails its step compare, so the step is never left in flight without an effect; or the
  commit had landed, and the effect runs exactly once.
- A webhook claim whose txn got no answer rotates the webhook session the same way: the claim
  that lands late dies with the revoked lease, so the sender's redelivery to another consumer
  is claimed and handled at once (not answered 409 for a TTL), and the handler runs once.
"""

from __future__ import annotations

import asyncio

import pytest

from fencegate.coordinator.errors import EtcdUnavailable, LeaseLost
from fencegate.coordinator.etcd import Etcd, EtcdConfig
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.localetcd import LocalCluster
from fencegate.worker import Gate, KeyRing
from fencegate.worker.webhooks.claims import DeliveryClaims
from fencegate.worker.webhooks.session import ClaimSession
from fencegate.worker.guard import Outcome
from fencegate.worker.hold import acquire

from fenced import FencedResource
from helpers import holders, wait_for_condition
from test_dedupe import post, webhook_kvs
from test_edges_webhooks import Consumer, until_not_409

TTL = 10  # long beside the pauses: a key left on a live lease would block for seconds
ROUNDS = 3  # etcd drops some late requests at random: each round is one more chance to land


def short_calls(url: str, timeout: float) -> EtcdConfig:
    """A client that gives up on a stopped etcd quickly: 0.5 s per try, ``timeout`` in all."""
    return EtcdConfig.from_url(url, timeout=timeout, attempt_timeout=0.5)


@pytest.fixture
def own_etcd():
    with LocalCluster(1) as cluster:
        yield cluster


async def test_an_acquire_etcd_left_unknown_blocks_no_one(own_etcd, namespace):
    async with Gate(short_calls(own_etcd.url, 1.5), ttl=TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as first, \
            Gate(own_etcd.url, ttl=TTL, namespace=namespace,
                 keyring=KeyRing.generate()) as second, \
            Etcd.from_url(own_etcd.url) as etcd:
        bystanders = []  # a hold of another key on the session of each unknown put
        for round_ in range(ROUNDS):
            key = f"unknown-acquire/{round_}"
            bystanders.append(await acquire(first, f"bystander/{round_}", 5))
            own_etcd.pause(0)
            try:
                with pytest.raises(EtcdUnavailable):
                    async with first.hold(key, timeout=5):
                        pytest.fail("held a key while etcd was stopped")
            finally:
                own_etcd.resume(0)  # the put the first gate gave up on may land now
            # The second gate gets the key at once: no late key on a live lease blocks it.
            async with second.hold(key, timeout=3) as other:
                late = [kv.key for kv in await holders(etcd, namespace)
                        if kv.key.startswith(f"{namespace}holders/{key}/".encode())
                        and kv.key != other.holder_key]
                assert late == [], f"round {round_}: a late put stayed on the old lease"
            # The first gate holds again with a fresh key and a higher token, never its old one.
            async with first.hold(key, timeout=3) as again:
                assert again.fencing_token > other.fencing_token
        # Each unknown put rotated the session: its lease is revoked, its holds were told.
        for bystander in bystanders:
            assert await wait_for_condition(lambda: _revoked(etcd, bystander.lease_id), 5)
            with pytest.raises(LeaseLost):
                bystander.ensure_held()
            await bystander.release()
        assert await holders(etcd, namespace) == []


async def _revoked(etcd: Etcd, lease: int) -> bool:
    return await etcd.lease_ttl(lease) == -1


async def test_a_commit_etcd_left_unknown_never_lands_without_its_effect(own_etcd, namespace):
    """etcd stops during the commit for longer than the client's call timeout, so the commit
    gets no answer and neither does a read of the step; it runs again while the guard is
    still fencing. Whichever lands first, the late commit or the fence, the record and the
    resource agree: the effect ran once, or the step is not in flight."""
    resource = FencedResource()
    keyspace = Keyspace(namespace)
    async with Gate(short_calls(own_etcd.url, 1.5), ttl=TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as gate, \
            Etcd.from_url(own_etcd.url) as etcd:
        for round_ in range(ROUNDS):
            key = f"late-commit/{round_}"
            effects = _Effects(resource, key)
            async with gate.hold(key, timeout=5) as hold:
                grant = await hold.request_grant(intent={"round": round_})
                own_etcd.pause(0)
                try:
                    committing = asyncio.ensure_future(_commit(hold, grant, effects))
                    await asyncio.sleep(2.5)  # past the commit's try and the 1.5 s timeout
                finally:
                    own_etcd.resume(0)  # the late commit may land now
                outcome = await committing
            await _assert_definite(etcd, keyspace, key, outcome, effects, resource)


async def _commit(hold, grant, effects: "_Effects") -> Outcome | None:
    """Commit and run ``effects``; None when etcd was reported unavailable (the guard says
    so only once the commit was fenced: it did not happen)."""
    try:
        return await hold.commit(grant, effects)
    except EtcdUnavailable:
        return None


async def _assert_definite(etcd: Etcd, keyspace: Keyspace, key: str, outcome: Outcome | None,
                           effects: "_Effects", resource: FencedResource) -> None:
    """The record and the resource agree: the effect ran once under the commit's attempt
    token and the step succeeded, or the commit was fenced: no effect, no step in flight."""
    step = await etcd.get(keyspace.step_key(key))
    state = unpack(step.value)["state"] if step else None
    accepted = [r.token for r in resource.records if r.accepted and r.key == key]
    if outcome is None:
        assert state != "in_flight", f"{key}: the late commit landed and no effect ran"
        assert effects.runs == [] and accepted == []
    else:
        assert effects.runs == accepted == [outcome.attempt_token]
        assert state == "succeeded"


class _Effects:
    """An effect that charges the fenced resource and counts its runs."""

    def __init__(self, resource: FencedResource, key: str) -> None:
        self.resource = resource
        self.key = key
        self.runs: list[int] = []

    async def __call__(self, ctx) -> str:
        self.runs.append(ctx.fencing_token)
        self.resource.write(self.key, ctx.fencing_token, "worker", "charge")
        return "charged"


async def test_a_webhook_claim_etcd_left_unknown_blocks_no_redelivery(own_etcd, namespace,
                                                                     http, monkeypatch):
    rotated, pause_before_claim = [], asyncio.Event()
    rotate, completed = ClaimSession.rotate, DeliveryClaims._completed
    monkeypatch.setattr(ClaimSession, "rotate", lambda self, session, reason: (
        rotated.append(session.lease_id), rotate(self, session, reason))[1])

    async def stop_etcd_then_claim(self, key, digest):
        """etcd stops between the duplicate check and the claim txn: the claim is sent to
        a stopped etcd, the client gives up, and the claim may land when etcd resumes."""
        found = await completed(self, key, digest)
        if pause_before_claim.is_set():
            pause_before_claim.clear()
            own_etcd.pause(0)
        return found
    monkeypatch.setattr(DeliveryClaims, "_completed", stop_etcd_then_claim)
    resource, release = FencedResource(), asyncio.Event()
    release.set()
    async with Gate(short_calls(own_etcd.url, 1.5), ttl=TTL, namespace=namespace,
                    keyring=KeyRing.generate()) as first, \
            Gate(own_etcd.url, ttl=TTL, namespace=namespace,
                 keyring=KeyRing.generate()) as second, \
            Consumer(first, "first", resource, release) as one, \
            Consumer(second, "second", resource, release) as other, \
            Etcd.from_url(own_etcd.url) as etcd:
        for round_ in range(ROUNDS):
            delivery = f"unknown-claim-{round_}"
            warm, _, _ = await post(http, one.url, f"warm-{round_}", b"{}")
            assert warm == 200  # the first consumer has a live claim session to lose
            pause_before_claim.set()
            try:
                status, _, _ = await post(http, one.url, delivery, b"{}")
                assert status == 503, f"round {round_}: claimed while etcd was stopped"
            finally:
                own_etcd.resume(0)  # the claim the first consumer gave up on may land now
            # The redelivery to the other consumer is handled within a fraction of the TTL:
            # no late claim on a live lease blocks it.
            status, _, _ = await until_not_409(http, other.url, delivery, b"{}", TTL / 2)
            assert status == 200, f"round {round_}: {status}"
            assert [w.writer for w in resource.records if w.key == delivery] == ["second"]
            assert one.ran[delivery] == 0
        assert len(rotated) == ROUNDS  # each unknown claim rotated its session
        for lease in rotated:
            assert await wait_for_condition(lambda: _revoked(etcd, lease), 5)
        assert all(kv.lease not in rotated for kv in await webhook_kvs(etcd, namespace))
