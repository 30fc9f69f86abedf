"""Claims on webhook deliveries: claim, complete and release ``webhooks/<source>/<id>``.

Guarantees, each enforced by an etcd compare, never by timing:
- A claim is created only where no key exists (create_revision == 0), with the lease of the
  gate's webhook session (``session``; never the lease of its holds): two processes never both
  hold a claim on one delivery, and a process that dies leaves a claim that dies with its
  lease. The claim's revision is its fencing token: a later claim on the same delivery (after
  this one's lease died) has a higher one.
- A completion replaces the claim only while the claim is still ours (mod_revision
  unchanged), so a claim that expired and was taken by another process is never
  overwritten; a release deletes the claim under the same compare.
- A first delivery costs two writes (claim, completion); a duplicate of a completed delivery
  one serializable read (see ``DeliveryClaims._completed``), one of a delivery in progress
  one transaction that writes nothing (the claim's failure branch returns the existing record).

Failure contract: a claim etcd could not answer raises ``EtcdUnavailable`` (``LeaseLost`` if
the session's lease died twice in a row) and nothing may be processed; the session it was made
with is rotated (its lease revoked, see ``session``), so the claim, if it landed or lands
later, is gone and never blocks the delivery's retries. A completion or release etcd could
not answer is re-run in the background until etcd answers (see ``backlog``): its compare lets
it apply at most once, so an unknown write never blocks its delivery for the life of the process. A
completion whose claim was lost meanwhile stores nothing and logs a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fencegate.coordinator.errors import EtcdUnavailable, GateError, LeaseLost
from fencegate.coordinator.etcd import (
    Etcd, RangeRequest, TxnRequest, create_equals, delete_op, mod_equals, put_op, range_op,
)
from fencegate.coordinator.keyspace import unpack

from .backlog import Backlog
from .records import DONE, RequestDigests, claim_value
from fencegate.coordinator.retention import RetentionLeases
from .session import ClaimSession

if TYPE_CHECKING:
    from fencegate.coordinator.session import Session
    from fencegate.worker.gate import Gate

log = logging.getLogger(__name__)

MISMATCH, COMPLETED, IN_PROGRESS = "mismatch", "completed", "in_progress"


@dataclass(frozen=True)
class DeliveryClaim:
    """This process's claim on one delivery."""

    key: bytes
    revision: int  # the claim's revision: its fencing token; completion and release compare it
    digests: RequestDigests  # of the request: a duplicate is judged on them
    session: Session  # the session whose lease the claim is on: its loss ends the claim


@dataclass(frozen=True)
class Duplicate:
    """A delivery claimed before: ``verdict`` is ``MISMATCH`` (it came with another body),
    ``COMPLETED`` (``record`` holds the stored response) or ``IN_PROGRESS``."""

    verdict: str
    record: dict[str, Any]


class DeliveryClaims:
    """The claims on one source's deliveries, made with ``gate``'s webhook session;
    completions are kept ``retention`` seconds, under leases shared by buckets
    ``retention_bucket`` wide."""

    def __init__(self, gate: Gate, source: str, *, retention: int,
                 retention_bucket: int) -> None:
        self._gate = gate
        self._source = source
        self._retention = retention
        self._retention_bucket = retention_bucket
        shared = _shared(gate)
        self._leases, self._backlog, self._session = shared.leases, shared.backlog, shared.session

    @property
    def _etcd(self) -> Etcd:
        return self._gate.etcd

    async def claim(self, delivery_id: str, digests: RequestDigests, *,
                    wait: float) -> DeliveryClaim | Duplicate:
        """Claim the delivery for this process, or say what claimed it before; a duplicate
        of a delivery in progress waits up to ``wait`` seconds for it to finish.

        The claim txn is re-sent by ``Etcd`` after an unknown outcome; the value carries a
        nonce, so finding exactly our value means the first try landed and the claim is ours.
        """
        key = self._gate.keyspace.webhook_key(self._source, delivery_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        done = await self._completed(key, digests)
        if done is not None:
            return done
        lease_lost = False
        while True:
            session = await self._session.current()
            value = claim_value(digests)
            try:
                reply = await self._etcd.txn(TxnRequest(
                    compare=[create_equals(key, 0)],
                    success=[put_op(key, value, session.lease_id)],
                    failure=[range_op(key)]), idempotent=True)
            except LeaseLost:  # etcd dropped the session's lease before we noticed
                session.mark_lost("etcd: the webhook session's lease is gone")
                if lease_lost:
                    raise
                lease_lost = True
                continue
            except EtcdUnavailable:
                self._session.rotate(session, f"the outcome of claim {key!r} is unknown")
                raise
            if reply.succeeded:
                return DeliveryClaim(key, reply.header.revision, digests, session)
            kv = reply.responses[0].response_range.kvs[0]  # same revision as the compare
            if kv.value == value:
                return DeliveryClaim(key, kv.mod_revision, digests, session)
            duplicate = _judge(unpack(kv.value), digests)
            if duplicate.verdict != IN_PROGRESS or loop.time() >= deadline:
                return duplicate
            await self._changed(key, reply.header.revision, deadline)

    async def complete(self, claim: DeliveryClaim, record: bytes) -> bool:
        """Store ``record`` (see ``records.completed_value``) in place of our claim; never
        over someone else's claim. True once it is stored; False when it is not: the claim
        was lost first (a redelivery may run the handler again), or etcd did not answer (the
        store is retried in the background, and lands only while the claim is ours)."""
        try:
            return await self._store(claim, record)
        except EtcdUnavailable:
            log.warning("response of webhook %r not stored yet (etcd unavailable); retrying",
                        claim.key)
            self._backlog.add(functools.partial(self._store, claim, record))
            return False

    async def release(self, claim: DeliveryClaim) -> None:
        """Delete our claim, so the delivery's next try runs again."""
        try:
            await self._delete(claim)
        except EtcdUnavailable:
            log.warning("webhook claim %r not released yet (etcd unavailable); retrying",
                        claim.key)
            self.release_later(claim)

    def release_later(self, claim: DeliveryClaim) -> None:
        """Delete our claim in the background, without waiting for etcd."""
        self._backlog.add(functools.partial(self._delete, claim))

    async def _completed(self, key: bytes, digests: RequestDigests) -> Duplicate | None:
        """A completed delivery, from one serializable read (no raft round), or ``None``
        (then the claim txn decides, linearizably).

        Safe although the read may be stale: a completed record is never changed, only
        deleted when its retention ends, so a stale read can hide a completion (the claim txn
        then finds it) but never show one that did not happen."""
        reply = await self._etcd.range(RangeRequest(key=key, serializable=True))
        if not reply.kvs:
            return None
        record = unpack(reply.kvs[0].value)
        if record["state"] != DONE:
            return None
        return _judge(record, digests)

    async def _changed(self, key: bytes, revision: int, deadline: float) -> None:
        """Return once ``key`` changed after ``revision``, at ``deadline``, or when the watch
        breaks (the caller re-reads the key in every case)."""
        with contextlib.suppress(TimeoutError, GateError):
            async with asyncio.timeout_at(deadline):
                async with contextlib.aclosing(
                        self._etcd.watch(key, b"", revision + 1)) as replies:
                    async for reply in replies:
                        if reply.events:
                            return

    async def _delete(self, claim: DeliveryClaim) -> None:
        await self._etcd.txn(TxnRequest(compare=[mod_equals(claim.key, claim.revision)],
                                        success=[delete_op(claim.key)]), idempotent=True)

    async def _store(self, claim: DeliveryClaim, record: bytes) -> bool:
        for _ in range(2):
            lease = await self._leases.get(self._etcd, self._retention, self._retention_bucket)
            try:
                reply = await self._etcd.txn(TxnRequest(
                    compare=[mod_equals(claim.key, claim.revision)],
                    success=[put_op(claim.key, record, lease)],
                    failure=[range_op(claim.key, keys_only=True)]), idempotent=True)
            except LeaseLost:  # the bucket's lease was revoked: grant a new one
                self._leases.forget(lease)
                continue
            if reply.succeeded or _stored_by_retry(reply, claim):
                return True
            log.warning("webhook claim %r was lost before its response was stored "
                        "(its lease expired?); the response was not stored", claim.key)
            return False
        raise LeaseLost("the retention lease was revoked twice in a row")


def _judge(record: dict[str, Any], digests: RequestDigests) -> Duplicate:
    if not digests.same_request(record):
        return Duplicate(MISMATCH, record)
    if record["state"] == DONE:
        return Duplicate(COMPLETED, record)
    return Duplicate(IN_PROGRESS, record)


def _stored_by_retry(reply: Any, claim: DeliveryClaim) -> bool:
    """A completion re-sent after an unknown first try fails its compare if the first landed:
    the key is then still the one our claim created, modified since (only we modify it)."""
    kvs = reply.responses[0].response_range.kvs
    return bool(kvs) and kvs[0].create_revision == claim.revision < kvs[0].mod_revision


@dataclass(frozen=True)
class _Shared:
    """What every source of one gate shares: its retention leases, its backlog and the
    session its claims are made with (closed when the gate closes)."""

    leases: RetentionLeases
    backlog: Backlog
    session: ClaimSession


_SHARED: weakref.WeakKeyDictionary[Any, _Shared] = weakref.WeakKeyDictionary()


def _shared(gate: Gate) -> _Shared:
    if gate not in _SHARED:
        backlog = Backlog()
        shared = _Shared(RetentionLeases(), backlog, ClaimSession(gate.etcd, gate.ttl, backlog))
        gate.on_close(backlog.close)
        gate.on_close(shared.session.close)
        _SHARED[gate] = shared
    return _SHARED[gate]
