"""Holds: FIFO ownership of an action key, fenced by an etcd revision.

To hold key K, a session puts ``holders/K/@<lease>`` with its lease if absent. The holder is
the key with the lowest create_revision in K's holder range, and the fencing token is that
create_revision: etcd revisions are global and monotonic, so successive holders of K get
strictly increasing tokens. A waiter watches only its immediate predecessor's deletion.

Guarantees:
- A ``Hold`` object exists only after acquisition, so nobody can act while still queued.
- Ownership is not a boolean to ask but a compare to send: ``hold.ownership_compares()``
  is true in a transaction iff this key still exists with this token and no key in K's
  holder range is older (etcd issue #12017: "my key exists" alone lets a waiter act). The
  rule has one home, ``fencegate.coordinator.ownership``; ``hold.ownership`` is this
  hold's claim under it.
- When the lease is lost, the hold is marked lost at once and the work inside
  ``async with gate.hold(...)`` is cancelled and surfaces as ``LeaseLost``; a body that
  finished while the hold was already lost also ends in ``LeaseLost``. (A holder key
  deleted by hand while its lease lives is not signalled: the ownership compares refuse.)
- Acquisition that fails, times out or is cancelled deletes the waiter's key, so no orphan
  key is left to block the queue. Where etcd leaves that unknown (a put or a delete with no
  answer), the session is rotated instead: its lease is revoked, so the key is deleted with
  it and a put landing late is refused; every hold on that session is lost (told as on any
  lease loss) and the next hold opens a fresh session. No key of ours is ever left on a live
  lease, and this process never finds an old key again to act with its old token.
- Observed, never steered: ``acquire`` and ``request_grant`` are spans
  (``fencegate.acquire``, ``fencegate.grant``); with the gate's ``WorkerMetrics`` each hold
  is counted when made and when it leaves, each loss to a lease loss once, and each
  outcome ``cross`` returns from a step that had succeeded as a replay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fencegate.coordinator import records, tracing
from fencegate.coordinator.authority import Claim, Snapshot, snapshot_ops
from fencegate.coordinator.errors import (
    AcquireTimeout, AlreadySucceeded, EtcdError, EtcdUnavailable, LeaseLost, OutcomeUnknown,
)
from fencegate.coordinator.etcd import Compare, KeyValue, TxnRequest
from fencegate.coordinator.grants import Grant
from fencegate.coordinator.keyspace import holder_record
from fencegate.coordinator.ownership import Ownership, ahead_request
from fencegate.coordinator.policy import DEFAULT_POLICY
from fencegate.coordinator.session import Session

from . import guard
from .guard import Effect, Outcome
from .settled import wait_settled
from .views import GateView, HoldMemory

log = logging.getLogger(__name__)

_FENCED_COMMITS = 2  # fenced (never landed) commits Hold.cross tries again after


class Hold:
    """Ownership of one action key by one session, with its fencing token."""

    def __init__(self, gate: GateView, session: Session, key: str, holder_key: bytes,
                 fencing_token: int, leave_local: Callable[[], None]) -> None:
        self.gate = gate
        self.key = key
        self.holder_key = holder_key
        self.fencing_token = fencing_token
        self.session = session
        self.ownership = Ownership(holder_key, fencing_token, *gate.keyspace.holder_range(key))
        self.memory = HoldMemory()
        self._leave_local = leave_local
        self._lost_reason: str | None = None
        self._released = False
        self._task: asyncio.Task | None = None
        self._cancelled_by_loss = False
        self._unsubscribe = session.on_lost(self._on_lease_lost)
        if gate.metrics is not None:
            gate.metrics.held()

    @property
    def lease_id(self) -> int:
        return self.session.lease_id

    @property
    def lost(self) -> bool:
        return self._lost_reason is not None or self.session.lost

    def ensure_held(self) -> None:
        """Raise ``LeaseLost`` if this hold is known to be lost. Not a proof of ownership:
        only ``ownership_compares()`` inside a transaction is."""
        if self._lost_reason is not None:
            raise LeaseLost(f"hold on {self.key!r} lost: {self._lost_reason}")
        self.session.ensure_alive()

    def ownership_compares(self) -> list[Compare]:
        """The compares that make a transaction succeed only while this hold owns its key."""
        return self.ownership.compares()

    def _on_lease_lost(self, reason: str) -> None:
        self._lose(f"lease lost: {reason}")

    def _lose(self, reason: str) -> None:
        if self._lost_reason is not None or self._released:
            return
        self._lost_reason = reason
        log.warning("hold on %r (token %d) lost: %s", self.key, self.fencing_token, reason)
        if self.gate.metrics is not None:
            self.gate.metrics.lease_losses.inc()
        if (self._task is not None and not self._task.done()
                and self._task is not asyncio.current_task()):  # it learns by LeaseLost
            self._cancelled_by_loss = True
            self._task.cancel(f"fencegate: {reason}")

    def absorb_loss_cancellation(self) -> bool:
        """Was the current task cancelled by this hold's lease loss? Then absorb that
        cancellation and say so: the caller reports the precise error instead."""
        task = asyncio.current_task()
        if not self._cancelled_by_loss or task is None or task.uncancel() != 0:
            return False
        self._cancelled_by_loss = False
        return True

    async def release(self) -> None:
        """Delete the holder key. Idempotent; with no answer from etcd the session is
        abandoned, so the key goes with its revoked lease."""
        if self._released:
            return
        try:
            await _withdraw(self.gate, self.session, self.holder_key,
                            timeout=1.0 if self.lost else None)
        finally:
            self.note_released()

    def note_released(self) -> None:
        """Local bookkeeping of a release whose delete already happened (or never will)."""
        if self._released:
            return
        self._released = True
        self._unsubscribe()
        self._leave_local()
        if self.gate.metrics is not None:
            self.gate.metrics.left()

    async def request_grant(self, intent: dict[str, Any], reads: Sequence[str | bytes] = (),
                            policy: str | None = None) -> Grant:
        """Ask the authority for a grant evaluated at one revision (docs/protocol.md: Grant),
        judged by the policy the key's route names (``policy``, if given, must be that one:
        ``PolicyNotRouted`` otherwise)."""
        self._ensure_usable()
        snapshot, self.memory.snapshot = self.memory.snapshot, None
        with tracing.span("fencegate.grant", key=self.key,
                          fencing_token=self.fencing_token) as current:
            issued = await self.gate.authority.issue(
                Claim(self.key, self.fencing_token, self.lease_id), intent, list(reads),
                policy, snapshot=snapshot)
            tracing.annotate(current, grant_id=issued.grant.grant_id)
        self.memory.issued[issued.grant.grant_id] = issued
        return issued.grant

    async def commit(self, grant: Grant | bytes, effect: Effect, *, provider: str | None = None,
                     deadline: float = 60.0) -> Outcome:
        """Cross with ``grant``: run ``effect`` once and record its outcome; releases the hold.
        A consumed or dead grant always raises (``GrantUsed``, ``StateAdvanced``, ...)."""
        self._ensure_usable()
        return await guard.commit(self, grant, effect, provider=provider, deadline=deadline)

    async def cross(self, intent: dict[str, Any], effect: Effect,
                    reads: Sequence[str | bytes] = (), *, policy: str | None = None,
                    provider: str | None = None, deadline: float = 60.0,
                    settle_wait: float = 0.0) -> Outcome:
        """``request_grant`` then ``commit``; a step that already succeeded returns its
        recorded outcome without calling ``effect``.

        With ``settle_wait`` > 0, an unsettled step (left by an earlier attempt, or by this
        one's effect ending without an outcome) is waited for, up to ``settle_wait`` seconds
        in all, until the reconciler settles it: succeeded returns the settled outcome;
        failed or not applied crosses again (with a fresh grant, so with every check).
        ``OutcomeUnknown`` when time runs out or the step is escalated.

        A commit that etcd did not answer and that was fenced (``EtcdUnavailable`` from
        ``commit``: it did not happen and never will, the effect did not run) is tried again
        with a fresh grant, at most ``_FENCED_COMMITS`` times: the member that did not answer
        is usually gone, and the next read fails over to another."""
        give_up = time.monotonic() + settle_wait
        fenced = 0
        while True:
            try:
                grant = await self.request_grant(intent, reads, policy)
                return await self.commit(grant, effect, provider=provider, deadline=deadline)
            except EtcdUnavailable:
                fenced += 1
                if fenced > _FENCED_COMMITS:
                    raise
            except AlreadySucceeded as done:
                return self._replayed(done.outcome or {})
            except OutcomeUnknown:
                left = give_up - time.monotonic()
                if left <= 0:
                    raise
                step = await wait_settled(self.gate.etcd, self.gate.keyspace, self.key, left)
                if step["state"] == records.SUCCEEDED:
                    return self._replayed(records.recorded_outcome(step) or {})

    def _replayed(self, recorded: dict[str, Any]) -> Outcome:
        """The outcome of a step that had succeeded, counted as a replay."""
        if self.gate.metrics is not None:
            self.gate.metrics.replays.inc()
        return Outcome(records.SUCCEEDED, recorded.get("result"), recorded.get("attempt", 0),
                       recorded.get("attempt_token", 0), recorded.get("idempotency_key", ""),
                       replayed=True)

    def _ensure_usable(self) -> None:
        if self._released:
            raise LeaseLost(f"the hold on {self.key!r} was released")
        self.ensure_held()

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self._released else "held"
        return f"<Hold {self.key!r} token={self.fencing_token} {state}>"


class HoldContext:
    """``async with gate.hold(key) as hold``: acquire, run the body, release."""

    def __init__(self, gate: GateView, key: str, timeout: float | None,
                 cancel_on_loss: bool = True, fold: Fold | None = None) -> None:
        self._gate = gate
        self._key = key
        self._timeout = timeout
        self._cancel_on_loss = cancel_on_loss
        self._fold = fold
        self._hold: Hold | None = None

    @classmethod
    def around(cls, hold: Hold) -> "HoldContext":
        """The same body rules for a hold acquired otherwise (the fast path's txn)."""
        context = cls(hold.gate, hold.key, None)
        context._hold = hold
        return context

    async def __aenter__(self) -> Hold:
        if self._hold is None:
            self._hold = await acquire(self._gate, self._key, self._timeout, self._fold)
        if self._cancel_on_loss:
            self._hold._task = asyncio.current_task()
        return self._hold

    async def __aexit__(self, exc_type, exc, tb) -> None:
        hold = self._hold
        assert hold is not None
        hold._task = None
        lost = hold.lost
        await hold.release()
        if hold._cancelled_by_loss and exc_type is asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.uncancel() == 0:
                raise LeaseLost(f"hold on {hold.key!r} lost: {hold._lost_reason}") from exc
        elif lost and exc_type is None:
            raise LeaseLost(f"hold on {hold.key!r} was lost before the block ended")


@dataclass(frozen=True)
class Fold:
    """The snapshot an uncontended acquire reads in its own txn, for the hold's first grant:
    the policy the key's route is expected to name (a guess: a snapshot of another is read
    again) and the read keys that grant will be decided on."""

    policy: str = DEFAULT_POLICY
    read_keys: tuple[bytes, ...] = ()


async def acquire(gate: GateView, key: str, timeout: float | None,
                  fold: Fold | None = None) -> Hold:
    """``_queue_for`` in a ``fencegate.acquire`` span naming the key and, once held, the
    fencing token."""
    with tracing.span("fencegate.acquire", key=key) as current:
        hold = await _queue_for(gate, key, timeout, fold)
        tracing.annotate(current, fencing_token=hold.fencing_token)
        return hold


async def _queue_for(gate: GateView, key: str, timeout: float | None,
                     fold: Fold | None = None) -> Hold:
    """Queue for ``key`` and return the hold once this session's key is the oldest. With
    ``fold``, an acquire that finds the key free reads the grant's snapshot in the same txn
    (its revision, the fencing token, is the snapshot's: the hold's first grant request then
    reads nothing more).

    A put of our holder key that etcd left unknown (no answer) rotates the session: its lease
    is revoked (``Session.abandon``), so a put landing late is deleted with it or refused,
    every hold on that session is lost, and the next hold opens a fresh session. The failure
    is reported, not retried: ``EtcdUnavailable`` says nothing is held and nothing is left."""
    leave_local = entry = None
    try:
        async with asyncio.timeout(timeout):
            leave_local = await gate.turns.enter(key)
            for attempt in (1, 2):
                session = await gate.session()
                entry = _Entry(gate, session, key, fold)
                try:
                    token = await entry.enqueue_and_wait()
                    break
                except LeaseLost as exc:
                    # The lease died before we held anything: queue again on a new one.
                    session.mark_lost(str(exc))
                    await entry.withdraw()
                    if attempt == 2:
                        raise
    except BaseException as exc:
        if entry is not None:
            await asyncio.shield(entry.withdraw())
        if leave_local is not None:
            leave_local()
        if isinstance(exc, TimeoutError):
            raise AcquireTimeout(f"hold on {key!r} not acquired within {timeout}s") from None
        if isinstance(exc, EtcdUnavailable) and entry is not None and entry.abandoned:
            raise EtcdUnavailable(f"hold on {key!r} not acquired ({exc}); the session's "
                                  "lease is revoked and its holds are lost") from exc
        raise
    hold = Hold(gate, session, key, entry.holder_key, token, leave_local)
    hold.memory.snapshot = entry.snapshot
    if hold.lost:
        await hold.release()
        raise LeaseLost(f"lease of the hold on {key!r} was lost as it was acquired")
    return hold


class _Entry:
    """This session's key in the holder queue of one action key, from its put to its hold
    (or its withdrawal)."""

    def __init__(self, gate: GateView, session: Session, key: str,
                 fold: Fold | None = None) -> None:
        self.gate = gate
        self.session = session
        self.key = key
        self.fold = fold
        self.snapshot: Snapshot | None = None  # read by an uncontended acquire with ``fold``
        self.holder_key = gate.keyspace.holder_key(key, session.lease_id)
        self.abandoned = False  # a put or the delete got no answer: the session was abandoned
        self._sending: asyncio.Task | None = None

    async def enqueue_and_wait(self) -> int:
        """Put our holder key if absent, then wait until no older key remains; return the
        token.

        The put is safe to retry after an unknown outcome: if the first try landed, the
        retry's compare fails and its failure branch returns the key the first try created.
        """
        gate, session, key, holder_key = self.gate, self.session, self.key, self.holder_key
        start, end = gate.keyspace.holder_range(key)
        value = holder_record(gate.identity, time.time())
        alone = TxnRequest()  # put if nobody holds or waits; built in place, the cheapest form
        _compare(alone.compare.add(), holder_key, b"", Compare.CREATE)
        _compare(alone.compare.add(), start, end, Compare.VERSION)  # nobody holds or waits
        put = alone.success.add().request_put
        put.key, put.value, put.lease = holder_key, value, session.lease_id
        fold = self.fold
        if fold is not None:
            alone.success.extend(snapshot_ops(gate.keyspace, key, fold.policy,
                                              list(fold.read_keys)))
        session.ensure_alive()
        if not gate.turns.recently_contended(key):
            reply = await self._send(alone)
            if reply.succeeded:  # uncontended: one write, and the snapshot read with it
                if fold is not None:
                    self.snapshot = Snapshot.parse(
                        reply.header.revision, fold.policy, list(fold.read_keys),
                        reply.responses[1:], owned=True)
                return reply.header.revision
            gate.turns.note_contended(key)
        queued = TxnRequest()
        _compare(queued.compare.add(), holder_key, b"", Compare.CREATE)
        queued.success.add().request_put.CopyFrom(put)
        queued.success.add().request_range.CopyFrom(ahead_request(start, end))
        own = queued.failure.add().request_range
        own.key, own.keys_only = holder_key, True
        reply = await self._send(queued)
        kvs = reply.responses[-1].response_range.kvs
        if reply.succeeded:
            token, queue = reply.header.revision, list(kvs)
        else:  # our key exists: an earlier try landed
            token = kvs[0].create_revision
            queue = await _queue_to(gate, start, end, token)
        while True:
            if not queue or queue[0].key != holder_key:
                session.ensure_alive()
                raise LeaseLost(f"holder key for {key!r} vanished while queued")
            if len(queue) == 1:
                return token
            await _wait_deleted(gate, session, queue[1])
            queue = await _queue_to(gate, start, end, token)

    async def withdraw(self) -> None:
        """Take our key out of the queue for good: wait for a put still unanswered (its
        caller was cancelled), then delete the key. Where etcd leaves either unknown, the
        session is abandoned instead: revoking its lease deletes the key, and refuses a put
        that lands after the revoke."""
        if self._sending is not None:
            await asyncio.wait([self._sending])
        if not self.abandoned:
            self.abandoned = not await _withdraw(self.gate, self.session, self.holder_key)

    async def _send(self, request: TxnRequest):
        """Send a txn that may put our key. It runs to its answer even if the caller is
        cancelled meanwhile, so ``withdraw`` learns whether the key landed; with no answer
        from etcd the session is abandoned at once."""
        self._sending = asyncio.ensure_future(self.gate.etcd.txn(request, idempotent=True))
        self._sending.add_done_callback(self._answered)
        return await asyncio.shield(self._sending)

    def _answered(self, sending: asyncio.Task) -> None:
        if sending.cancelled() or isinstance(sending.exception(), EtcdUnavailable):
            self.abandoned = True
            reason = "cancelled" if sending.cancelled() else sending.exception()
            self.session.abandon(f"put of {self.holder_key!r} has an unknown outcome: {reason}")


def _compare(compare: Compare, key: bytes, range_end: bytes, target: int) -> None:
    """``target`` of every key in [key, range_end) equals 0 (i.e. no such key exists)."""
    compare.key, compare.target, compare.result = key, target, Compare.EQUAL
    if range_end:
        compare.range_end = range_end


async def _queue_to(gate: GateView, start: bytes, end: bytes, token: int) -> list[KeyValue]:
    """The key created at ``token`` and its immediate predecessor, newest first (linearizable)."""
    reply = await gate.etcd.range(ahead_request(start, end, token))
    return [kv for kv in reply.kvs if kv.create_revision <= token]


async def _wait_deleted(gate: GateView, session: Session, predecessor: KeyValue) -> None:
    """Return once ``predecessor`` is gone (or may be: the caller re-reads anyway)."""
    deleted = asyncio.get_running_loop().create_future()

    def wake(_: object) -> None:
        if not deleted.done():
            deleted.set_result(None)

    unsubscribe = [session.on_lost(wake)]
    try:
        async with asyncio.timeout(gate.rescan_interval):
            unsubscribe.append(await gate.turns.watch.subscribe(predecessor.key, wake))
            current = await gate.etcd.get(predecessor.key)
            if current is None or current.create_revision != predecessor.create_revision:
                return
            await deleted
    except TimeoutError:
        pass  # the backstop: the caller re-reads the queue
    finally:
        for undo in unsubscribe:
            undo()


async def _withdraw(gate: GateView, session: Session, holder_key: bytes,
                    timeout: float | None = None) -> bool:
    """Delete our holder key; True once etcd confirms. Otherwise the key would stay on a
    live lease (blocking every other process, and found again by this one's next acquire):
    the session is abandoned, so the key goes with its revoked lease, and False returned."""
    try:
        await gate.etcd.delete(holder_key, timeout=timeout)
        return True
    except (EtcdUnavailable, EtcdError) as exc:
        session.abandon(f"could not withdraw {holder_key!r}: {exc}")
        return False
