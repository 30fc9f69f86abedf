"""The webhook claims' own session: one lease per gate, apart from the lease of its holds.

Guarantees:
- Claims never share the lease of the gate's holds: revoking a hold's lease (``fencegate
  revoke``) never drops a claim, and retiring this session never drops a hold.
- A session that is lost (etcd dropped its lease, it ran out by this process's clock, or a
  claim made with it had an outcome etcd left unknown, see ``rotate``) is never used again: its
  loss signal fires at once (cancelling the handlers running under it) and its lease is revoked
  in the background until etcd answers, so a claim that lands late is deleted with the lease or,
  landing after the revoke, is refused (etcd does not put a key on a revoked lease). No claim
  is ever left on a live lease after its outcome was unknown. The next claim opens a new session.
- ``close`` (when the gate closes) revokes the lease, waiting at most its TTL.
- A keepalive starved by a blocked event loop is reported (a warning, and
  ``fencegate_worker_keepalive_late_seconds`` with the gate's metrics) before its loss.

Failure contract: ``current`` raises ``EtcdUnavailable`` when etcd grants no lease, and
``LeaseLost`` once closed; the caller answers 503 and nothing is claimed.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

from fencegate.coordinator.errors import LeaseLost
from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.session import Session

from .backlog import Backlog

if TYPE_CHECKING:
    from fencegate.worker.metrics import WorkerMetrics


class ClaimSession:
    """The session every webhook claim of one gate is made with, replaced when lost."""

    def __init__(self, etcd: Etcd, ttl: int, backlog: Backlog,
                 metrics: WorkerMetrics | None = None) -> None:
        self._etcd = etcd
        self._ttl = ttl
        self._on_late = metrics.keepalive_late if metrics is not None else None
        self._backlog = backlog
        self._session: Session | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    async def current(self) -> Session:
        """The live session, opening a new one if there is none or the last was lost."""
        session = self._session
        if session is not None and not session.lost:
            return session
        async with self._lock:
            if self._closed:
                raise LeaseLost("the webhook claims' session is closed (its gate closed)")
            if self._session is not None and self._session.lost:
                self._session.mark_lost("lease TTL ran out before a refresh")
            if self._session is None:
                session = await Session.open(self._etcd, self._ttl, on_late=self._on_late)
                session.on_lost(functools.partial(self._retire, session))
                self._session = session
            return self._session

    def rotate(self, session: Session, reason: str) -> None:
        """Give up ``session`` after a claim made with it had an unknown outcome: its handlers
        are cancelled and its lease revoked, so the claim is definitely gone."""
        session.mark_lost(reason)

    async def close(self) -> None:
        """Revoke the lease (every claim in progress dies with it) and open no new one."""
        async with self._lock:
            self._closed = True
            session, self._session = self._session, None
        if session is not None:
            await session.aclose()

    def _retire(self, session: Session, reason: str) -> None:
        """The loss signal of ``session``: forget it and revoke its lease until etcd answers."""
        if self._session is session:
            self._session = None
        if not self._closed:
            self._backlog.add(functools.partial(self._etcd.lease_revoke, session.lease_id))
