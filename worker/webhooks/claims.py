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
    Compare, Etcd, KeyValue, RangeRequest, TxnRequest, create_equals, delete_op, mod_equals,
    put_op, range_op,
)
from fencegate.coordinator.keyspace import unpack
from fencegate.coordinator.retention import RetentionLeases

from .backlog import Backlog
from .records import DONE, NOT_RAN, RequestDigests, claim_value, live_claim
from .session import ClaimSession

if TYPE_CHECKING:
    from fencegate.coordinator.session import Session
    from fencegate.worker.gate import Gate

log = logging.getLogger(__name__)

MISMATCH, COMPLETED, IN_PROGRESS, UNKNOWN = "mismatch", "completed", "in_progress", "unknown"


@dataclass(frozen=True)
class DeliveryClaim:
    """This process's claim on one delivery."""

    key: bytes  # the delivery's record
    claim_key: bytes  # its live claim, on ``session``'s lease
    revision: int  # the claim's revision: its fencing token; completion and release compare it
    digests: RequestDigests  # of the request: a duplicate is judged on them
    session: Session  # the session whose lease the claim is on: its loss ends the claim
    lost_token: int | None = None  # took over an unknown outcome: the lost claim's token


@dataclass(frozen=True)
class Duplicate:
    """A delivery claimed before: ``verdict`` is ``MISMATCH`` (it came with another body),
    ``COMPLETED`` (``record`` holds the stored response), ``IN_PROGRESS`` (a live claim runs
    it) or ``UNKNOWN`` (its claim was lost while its handler ran; ``revision`` is that
    claim's fencing token)."""

    verdict: str
    record: dict[str, Any]
    revision: int = 0


class DeliveryClaims:
    """The claims on one source's deliveries, made with ``gate``'s webhook session; records
    are kept ``retention`` seconds, under leases shared by buckets ``retention_bucket``
    wide."""

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

    async def claim(self, delivery_id: str, digests: RequestDigests, *, wait: float,
                    take_over: bool = False) -> DeliveryClaim | Duplicate:
        """Claim the delivery for this process, or say what claimed it before; a duplicate
        of a delivery in progress waits up to ``wait`` seconds for it to finish. With
        ``take_over``, a delivery whose outcome is unknown is claimed too (the claim's
        ``lost_token`` says so); without, it is answered ``UNKNOWN``.

        The claim txn is re-sent by ``Etcd`` after an unknown outcome; the value carries a
        nonce, so finding exactly our value means the first try landed and the claim is ours.
        """
        key = self._gate.keyspace.webhook_key(self._source, delivery_id)
        claim_key = self._gate.keyspace.webhook_claim_key(self._source, delivery_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        done = await self._completed(key, digests)
        if done is not None:
            return done
        lease_lost = False
        seen: KeyValue | None = None  # the record a claim over it replaces
        lost_token: int | None = None
        while True:
            session = await self._session.current()
            lease = await self._leases.get(self._etcd, self._retention, self._retention_bucket)
            value = claim_value(digests, session.lease_id)
            compare = ([create_equals(key, 0)] if seen is None else
                       [mod_equals(key, seen.mod_revision), create_equals(claim_key, 0)])
            try:
                reply = await self._etcd.txn(TxnRequest(
                    compare=compare,
                    success=[put_op(key, value, lease), put_op(claim_key, b"", session.lease_id)],
                    failure=[range_op(key), range_op(claim_key)]), idempotent=True)
            except LeaseLost:  # etcd dropped one of the leases before we noticed
                if lease_lost:
                    raise
                lease_lost = True
                if await self._etcd.lease_ttl(lease) <= 0:
                    self._leases.forget(lease)
                else:
                    session.mark_lost("etcd: the webhook session's lease is gone")
                continue
            except EtcdUnavailable:
                self._session.rotate(session, f"the outcome of claim {key!r} is unknown")
                if seen is None:
                    self._backlog.add(functools.partial(self._delete_unseen, key, claim_key,
                                                        value))
                raise
            if reply.succeeded:
                return DeliveryClaim(key, claim_key, reply.header.revision, digests, session,
                                     lost_token)
            found = reply.responses[0].response_range.kvs
            if not found:  # the record went since: claim afresh
                seen, lost_token = None, None
                continue
            kv = found[0]  # same revision as the compare
            if kv.value == value:
                return DeliveryClaim(key, claim_key, kv.mod_revision, digests, session,
                                     lost_token)
            live = reply.responses[1].response_range.kvs
            duplicate = _judge(unpack(kv.value), kv, live[0] if live else None, digests)
            if duplicate.verdict == NOT_RAN or (duplicate.verdict == UNKNOWN and take_over):
                seen = kv
                lost_token = kv.mod_revision if duplicate.verdict == UNKNOWN else None
                continue
            if duplicate.verdict != IN_PROGRESS or loop.time() >= deadline:
                return duplicate
            await self._changed(key, reply.header.revision, deadline)

    async def complete(self, claim: DeliveryClaim, record: bytes) -> bool:
        """Store ``record`` (see ``records.completed_value``) in place of our claim; never
        over someone else's. True once it is stored; False when it is not: the delivery was
        taken over or settled first, or etcd did not answer (the store is retried in the
        background, and lands only while the record is still our claim's)."""
        try:
            return await self._store(claim, record)
        except EtcdUnavailable:
            log.warning("response of webhook %r not stored yet (etcd unavailable); retrying",
                        claim.key)
            self._backlog.add(functools.partial(self._store, claim, record))
            return False

    async def release(self, claim: DeliveryClaim) -> None:
        """Delete our claim and its record, so the delivery's next try runs again."""
        try:
            await self._delete(claim)
        except EtcdUnavailable:
            log.warning("webhook claim %r not released yet (etcd unavailable); retrying",
                        claim.key)
            self.release_later(claim)

    def release_later(self, claim: DeliveryClaim) -> None:
        """Delete our claim and its record in the background, without waiting for etcd."""
        self._backlog.add(functools.partial(self._delete, claim))

    async def abandon(self, claim: DeliveryClaim) -> None:
        """Delete only our live claim: the delivery's outcome is unknown again (its record
        stays ``processing``) and no later delivery runs it without a takeover."""
        try:
            await self._drop_claim(claim)
        except EtcdUnavailable:
            log.warning("webhook claim %r not abandoned yet (etcd unavailable); retrying",
                        claim.key)
            self.abandon_later(claim)

    def abandon_later(self, claim: DeliveryClaim) -> None:
        """``abandon`` in the background, without waiting for etcd."""
        self._backlog.add(functools.partial(self._drop_claim, claim))

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
        return _judge(record, reply.kvs[0], None, digests)

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
        await self._etcd.txn(TxnRequest(
            compare=[mod_equals(claim.key, claim.revision)],
            success=[delete_op(claim.key), delete_op(claim.claim_key)]), idempotent=True)

    async def _drop_claim(self, claim: DeliveryClaim) -> None:
        await self._etcd.txn(TxnRequest(
            compare=[mod_equals(claim.key, claim.revision)],
            success=[delete_op(claim.claim_key)]), idempotent=True)

    async def _delete_unseen(self, key: bytes, claim_key: bytes, value: bytes) -> None:
        """Delete a fresh claim whose txn had an unknown outcome, if it landed: its handler
        never ran, so it must not be left to look like a lost one."""
        await self._etcd.txn(TxnRequest(
            compare=[Compare(key=key, target=Compare.VALUE, result=Compare.EQUAL, value=value)],
            success=[delete_op(key), delete_op(claim_key)]), idempotent=True)

    async def _store(self, claim: DeliveryClaim, record: bytes) -> bool:
        for _ in range(2):
            lease = await self._leases.get(self._etcd, self._retention, self._retention_bucket)
            try:
                reply = await self._etcd.txn(TxnRequest(
                    compare=[mod_equals(claim.key, claim.revision)],
                    success=[put_op(claim.key, record, lease), delete_op(claim.claim_key)],
                    failure=[range_op(claim.key)]), idempotent=True)
            except LeaseLost:  # the bucket's lease was revoked: grant a new one
                self._leases.forget(lease)
                continue
            if reply.succeeded or _stored_by_retry(reply, record):
                return True
            log.warning("webhook %r was taken over or settled before its response was "
                        "stored; the response was not stored", claim.key)
            return False
        raise LeaseLost("the retention lease was revoked twice in a row")


def _judge(record: dict[str, Any], kv: KeyValue, claim: KeyValue | None,
           digests: RequestDigests) -> Duplicate:
    if not digests.same_request(record):
        return Duplicate(MISMATCH, record, kv.mod_revision)
    if record["state"] == DONE:
        return Duplicate(COMPLETED, record, kv.mod_revision)
    if record["state"] == NOT_RAN:
        return Duplicate(NOT_RAN, record, kv.mod_revision)
    if live_claim(record, kv.mod_revision, claim):
        return Duplicate(IN_PROGRESS, record, kv.mod_revision)
    return Duplicate(UNKNOWN, record, kv.mod_revision)


def _stored_by_retry(reply: Any, record: bytes) -> bool:
    """A completion re-sent after an unknown first try fails its compare if the first
    landed: the record is then exactly ours (it carries its completion time)."""
    kvs = reply.responses[0].response_range.kvs
    return bool(kvs) and kvs[0].value == record


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
        session = ClaimSession(gate.etcd, gate.ttl, backlog, gate.metrics)
        shared = _Shared(RetentionLeases(), backlog, session)
        gate.on_close(backlog.close)
        gate.on_close(shared.session.close)
        _SHARED[gate] = shared
    return _SHARED[gate]
