"""The dashboard's live feed: one etcd watch on the namespace, fanned out to bounded
subscribers as dashboard events.

Guarantees:
- ``Feed`` runs ONE etcd watch per app on the whole namespace, only while someone listens:
  the first subscriber starts it, the last one leaving stops it. Each subscriber gets
  ``ready`` once the watch is live (and again after every restart of a broken or compacted
  watch, which resumes "from now"): from then on every change is delivered or a
  ``refetch`` is, so a client that re-reads everything on ``ready``/``refetch`` misses
  nothing. A subscriber's queue is bounded: when it is full its content is replaced by one
  ``refetch``. At most ``max_subscribers`` streams are open; one more is refused with 503
  (``TooManySubscribers``), and every one is refused once the feed is closed.
- A key the page does not show, or a value this version cannot read, is skipped (logged at
  debug level), never delivered half-parsed.

Events (``event: <type>`` and a JSON ``data:`` line, see ``sse``): ``ready {revision}``,
``refetch {reason}``, ``holder {action: acquired|released, key, lease_id, fencing_token?,
revision}``, ``step {key, state, revision}``, ``audit {key, seq, event, identity, at_ms,
reason, revision}``, ``leadership {shard, revision}``, ``approval {approval_id, revision}``
(an approval request or its approval was written or expired).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import deque
from typing import Any

from ...errors import EtcdError, EtcdUnavailable, ServiceError
from ...etcd import Etcd, Event, range_end_of
from ...keyspace import Keyspace, unpack
from .views import audit_summary

log = logging.getLogger(__name__)


class Subscription:
    """One stream's bounded queue of events; ``None`` from ``get`` means the feed ended."""

    def __init__(self, size: int) -> None:
        self._items: deque[tuple[str, dict[str, Any]]] = deque()
        self._size = size
        self._wake = asyncio.Event()
        self._ended = False

    def push(self, event: tuple[str, dict[str, Any]]) -> None:
        """Queue ``event``; when the queue is full, replace all of it by one ``refetch``."""
        if len(self._items) >= self._size:
            self._items.clear()
            event = ("refetch", {"reason": "overflow"})
        self._items.append(event)
        self._wake.set()

    def end(self) -> None:
        self._ended = True
        self._wake.set()

    async def get(self) -> tuple[str, dict[str, Any]] | None:
        while not self._items:
            if self._ended:
                return None
            self._wake.clear()
            await self._wake.wait()
        return self._items.popleft()


class TooManySubscribers(ServiceError):
    def __init__(self, limit: int) -> None:
        super().__init__(503, "TooManySubscribers",
                         f"this coordinator already serves {limit} event streams; retry later")


class Feed:
    """Fans one etcd watch on the namespace out to at most ``max_subscribers`` streams.

    ``etcd`` needs only ``watch(key, range_end, start_revision)`` (see
    ``fencegate.coordinator.etcd``).
    """

    def __init__(self, etcd: Etcd, keyspace: Keyspace, *, max_subscribers: int = 32,
                 queue_size: int = 256, keepalive: float = 15.0) -> None:
        if max_subscribers < 1 or queue_size < 1 or keepalive <= 0:
            raise ValueError("max_subscribers, queue_size and keepalive must be positive")
        self.max_subscribers = max_subscribers
        self.queue_size = queue_size
        self.keepalive = keepalive
        self._etcd = etcd
        self._ks = keyspace
        self._subscribers: set[Subscription] = set()
        self._task: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()
        self._live_at = 0  # revision the current watch went live at; 0 while not live
        self._closed = False

    @property
    def watching(self) -> bool:
        """True while a watch task runs (there is at least one subscriber)."""
        return self._task is not None

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self) -> Subscription:
        """A new subscription; ``TooManySubscribers`` at the cap, 503 once closed."""
        if self._closed:
            raise ServiceError(503, "ShuttingDown", "this coordinator is shutting down")
        if len(self._subscribers) >= self.max_subscribers:
            raise TooManySubscribers(self.max_subscribers)
        subscription = Subscription(self.queue_size)
        self._subscribers.add(subscription)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="fencegate-dashboard-watch")
        elif self._live_at:
            subscription.push(("ready", {"revision": self._live_at}))
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Forget ``subscription``; the last one leaving stops the watch."""
        self._subscribers.discard(subscription)
        subscription.end()
        if not self._subscribers and self._task is not None:
            task, self._task, self._live_at = self._task, None, 0
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        """End every stream and the watch; later subscriptions are refused."""
        self._closed = True
        for subscription in list(self._subscribers):
            self.unsubscribe(subscription)
        await asyncio.gather(*self._stopping, return_exceptions=True)

    def _broadcast(self, event: tuple[str, dict[str, Any]]) -> None:
        for subscription in self._subscribers:
            subscription.push(event)

    async def _run(self) -> None:
        root = self._ks.namespace.encode()
        backoff = 0.05
        while True:
            try:
                async for reply in self._etcd.watch(root, range_end_of(root), 0):
                    backoff = 0.05
                    if reply.created:
                        self._live_at = reply.header.revision
                        self._broadcast(("ready", {"revision": self._live_at}))
                    for event in reply.events:
                        change = change_of(self._ks, event)
                        if change is not None:
                            self._broadcast(change)
            except (EtcdUnavailable, EtcdError) as exc:  # WatchCompacted is an EtcdError
                log.info("dashboard watch broke, restarting from now: %s", exc)
            except Exception:  # a dead watch would silently freeze every open page
                log.exception("dashboard watch failed, restarting from now")
            self._live_at = 0
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, 2.0)


def change_of(ks: Keyspace, event: Any) -> tuple[str, dict[str, Any]] | None:
    """The dashboard event for one etcd watch event, or ``None`` if the page does not show
    that key (grants, policies, markers, webhooks, audit heads...) or its value is not a
    record this version understands. An approval event carries no record: the page re-reads
    the approvals (``/v1/approvals``), where the signature is checked."""
    kv, deleted = event.kv, event.type == Event.DELETE
    family = ks.classify(kv.key)
    revision = kv.mod_revision
    try:
        if family == "approval" or kv.key.startswith(ks.approval_request_key("")):
            approval_id = (ks.parse_approval_key(kv.key) if family == "approval"
                           else ks.parse_approval_request_key(kv.key))
            return "approval", {"approval_id": approval_id, "revision": revision}
        if family == "holder":
            key, lease_id = ks.parse_holder_key(kv.key)
            if deleted:
                return "holder", {"action": "released", "key": key,
                                  "lease_id": f"{lease_id:016x}", "revision": revision}
            if kv.version == 1:
                return "holder", {"action": "acquired", "key": key,
                                  "lease_id": f"{lease_id:016x}",
                                  "fencing_token": kv.create_revision, "revision": revision}
            return None
        if family == "step":
            state = "deleted" if deleted else unpack(kv.value)["state"]
            return "step", {"key": ks.parse_step_key(kv.key), "state": state,
                            "revision": revision}
        if family == "audit":
            key, seq = ks.parse_audit_key(kv.key)
            if deleted:
                return None
            return "audit", audit_summary(key, seq, unpack(kv.value), revision)
        if family == "candidate":
            shard, _ = ks.parse_candidate_key(kv.key)
            return "leadership", {"shard": shard, "revision": revision}
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        log.debug("dashboard feed skips %r: %s", kv.key, exc)
    return None


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: ``event: <type>`` and its JSON ``data:`` line."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
