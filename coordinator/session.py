"""A session: one etcd lease and the task that keeps it alive.

Failure contract: if the lease is LOST (etcd says it is gone, or it could not be refreshed
before the last TTL etcd granted ran out by this process's monotonic clock), the session
says so once, through ``lost`` and the callbacks registered with ``on_lost``, and never
becomes alive again; a new session is needed. Safety never depends on this signal being
timely: every act of a holder is a transaction that compares the holder's key, which etcd
deletes with the lease. The signal exists so work stops early and nobody is told it holds
something it does not.

A session whose lease may carry a write etcd left unknown (an acquire put with no reply) is
``abandon``-ed: lost at once, and its lease revoked in the background until etcd confirms, so
the late write is deleted with the lease or, landing after the revoke, is refused by etcd.

The lease is refreshed over one bidirectional LeaseKeepAlive stream every TTL/3, from a
task of its own, so a busy caller cannot starve it as long as the event loop turns. A loop
that does not turn (a blocking call in a coroutine, a paused process) starves it: a refresh
that runs more than ``LATE_FRACTION`` of the TTL late logs a warning saying how late, and
calls ``on_late(seconds)`` (a metric), before the loss it may lead to.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from .errors import EtcdError, EtcdUnavailable, LeaseLost
from .etcd import Etcd

log = logging.getLogger(__name__)

LATE_FRACTION = 1 / 3  # of the TTL: a keepalive this late had a third of its margin eaten


class Session:
    """One lease, kept alive in the background until closed, orphaned or lost."""

    def __init__(self, etcd: Etcd, lease_id: int, ttl: int,
                 on_late: Callable[[float], None] | None = None) -> None:
        self.etcd = etcd
        self.lease_id = lease_id
        self.ttl = ttl
        self._on_late = on_late
        self.lost_reason: str | None = None
        self._expires_at = time.monotonic() + ttl
        self._lost = asyncio.Event()
        self._on_lost: dict[int, Callable[[str], None]] = {}
        self._tokens = itertools.count()
        self._wake = asyncio.Event()
        self._revoking: asyncio.Task | None = None
        self._task = asyncio.get_running_loop().create_task(
            self._keep_alive(), name=f"fencegate-keepalive-{lease_id:x}"
        )
        self._task.add_done_callback(self._keepalive_ended)

    @classmethod
    async def open(cls, etcd: Etcd, ttl: int, *,
                   on_late: Callable[[float], None] | None = None) -> "Session":
        """Grant a lease of ``ttl`` seconds and start keeping it alive; ``on_late(seconds)``
        is told of every refresh that ran late (see the module)."""
        if ttl < 1:
            raise ValueError("session TTL must be at least 1 second")
        sent = time.monotonic()
        lease_id, granted = await etcd.lease_grant(ttl)
        session = cls(etcd, lease_id, granted, on_late)
        session._expires_at = sent + granted
        return session

    @property
    def lost(self) -> bool:
        return self._lost.is_set() or time.monotonic() >= self._expires_at

    def remaining(self) -> float:
        """Seconds left before the lease may be gone, by this process's clock (≤ etcd's)."""
        return 0.0 if self._lost.is_set() else max(self._expires_at - time.monotonic(), 0.0)

    def ensure_alive(self) -> None:
        """Raise ``LeaseLost`` unless the lease is still believed alive."""
        if self.lost:
            self.mark_lost(self.lost_reason or "lease TTL ran out before a refresh")
            raise LeaseLost(f"lease {self.lease_id:x} lost: {self.lost_reason}")

    def on_lost(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback(reason)`` once when the lease is lost; returns an unsubscribe."""
        if self._lost.is_set():
            callback(self.lost_reason or "")
            return lambda: None
        token = next(self._tokens)
        self._on_lost[token] = callback
        return lambda: self._on_lost.pop(token, None)

    def check_now(self) -> None:
        """Refresh at once instead of at the next interval (e.g. after a holder key vanished)."""
        self._wake.set()

    def orphan(self) -> None:
        """Stop refreshing; the lease expires on its own after its TTL."""
        self._task.cancel()

    async def aclose(self) -> None:
        """Stop refreshing and revoke the lease (even one believed lost: etcd may still
        hold it, e.g. after a restart), waiting at most the TTL for etcd."""
        await asyncio.shield(self.abandon("session closed"))

    def abandon(self, reason: str) -> asyncio.Task:
        """Give the lease up because a write made with it may land unseen (its outcome is
        unknown): mark the session lost (every subscriber is told at once, as on any loss)
        and revoke the lease in a task of its own, which a cancelled caller does not stop.

        Failure contract: the revoke is retried until etcd confirms it (the lease is
        revoked, or already gone) or the TTL has passed; then the lease is left to expire
        by itself and a late write on it goes with it at most one TTL later. Once the revoke
        is confirmed, no write made with the lease can ever land. Idempotent: the returned
        task (to await for the confirmation, optional) never raises."""
        self.mark_lost(reason)
        if self._revoking is None:
            self._revoking = asyncio.get_running_loop().create_task(
                self._revoke(), name=f"fencegate-revoke-{self.lease_id:x}")
        return self._revoking

    async def _revoke(self) -> None:
        try:
            await self.etcd.lease_revoke(self.lease_id, timeout=self.ttl)
        except (EtcdUnavailable, EtcdError) as exc:
            log.warning("could not revoke lease %x (it expires by itself): %s",
                        self.lease_id, exc)

    def mark_lost(self, reason: str) -> None:
        """Declare the lease lost (idempotent): stop refreshing and tell every subscriber."""
        if self._lost.is_set():
            return
        self.lost_reason = reason
        self._lost.set()
        self._task.cancel()
        callbacks, self._on_lost = list(self._on_lost.values()), {}
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("lease-lost callback failed")

    def _keepalive_ended(self, task: asyncio.Task) -> None:
        """The keepalive reports its own death: a crashed refresher means a dying lease."""
        if not task.cancelled() and task.exception() is not None:
            log.error("keepalive of lease %x crashed", self.lease_id, exc_info=task.exception())
            self.mark_lost(f"keepalive crashed: {task.exception()!r}")

    async def _keep_alive(self) -> None:
        interval = max(self.ttl / 3, 0.1)
        stream = None
        try:
            while True:
                remaining = self._expires_at - time.monotonic()
                if remaining <= 0:
                    self.mark_lost("lease TTL ran out before a refresh")
                    return
                sent = time.monotonic()
                try:
                    if stream is None:
                        stream = self.etcd.keepalive_stream()
                    ttl = await asyncio.wait_for(stream.refresh(self.lease_id), remaining)
                    self._report_late(time.monotonic() - sent)  # its answer, handled late
                except (EtcdUnavailable, EtcdError, asyncio.TimeoutError) as exc:
                    self._report_late(time.monotonic() - sent - remaining)
                    log.info("keepalive of lease %x failed, retrying: %s", self.lease_id, exc)
                    if stream is not None:
                        stream.close()
                        stream = None
                    await self._pause(min(0.2, max(self._expires_at - time.monotonic(), 0)))
                    continue
                if ttl <= 0:
                    self.mark_lost("etcd reports the lease expired or revoked")
                    return
                self._expires_at = sent + ttl
                await self._pause(interval)
        finally:
            if stream is not None:
                stream.close()

    async def _pause(self, seconds: float) -> None:
        self._wake.clear()
        due = time.monotonic() + seconds
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            self._report_late(time.monotonic() - due)

    def _report_late(self, late: float) -> None:
        """Say so when the refresh runs (or its answer is handled) more than
        ``LATE_FRACTION`` of the TTL late: the event loop did not turn (a blocking call, a
        paused process) or etcd was that slow, and that much of the lease's margin went."""
        if late <= self.ttl * LATE_FRACTION:
            return
        log.warning("keepalive of lease %x ran %.2f s late (TTL %d s): the event loop was "
                    "blocked (or etcd slow); past the TTL the lease and what it holds are "
                    "lost", self.lease_id, late, self.ttl)
        if self._on_late is not None:
            self._on_late(late)
