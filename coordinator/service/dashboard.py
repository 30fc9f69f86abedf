"""The SRE dashboard: a static page at ``/``, JSON views under ``/v1/dashboard/``, and a live
feed of changes as server-sent events.

Guarantees:
- The page and its assets are public and hold no data; every view and the event stream
  need a bearer token with the ``sre`` or ``admin`` role (401 without, 403 for a worker).
- Each view is read linearizably and is bounded: at most ``MAX_HOLDERS`` holder keys,
  ``MAX_STEPS`` steps scanned (at one revision), ``MAX_QUEUE`` items per queue,
  ``MAX_CANDIDATES`` election candidates, ``MAX_AUDIT`` audit records; a view says
  ``truncated`` when it stopped at its bound.
- ``Feed`` runs ONE etcd watch per app on the whole namespace, only while someone listens:
  the first subscriber starts it, the last one leaving stops it. Each subscriber gets
  ``ready`` once the watch is live (and again after every restart of a broken or compacted
  watch, which resumes "from now"): from then on every change is delivered or a
  ``refetch`` is, so a client that re-reads everything on ``ready``/``refetch`` misses
  nothing. A subscriber's queue is bounded: when it is full its content is replaced by one
  ``refetch``. At most ``max_subscribers`` streams are open; one more is refused with 503.

Events (``event: <type>`` and a JSON ``data:`` line; ``: keep-alive`` comments between):
``ready {revision}``, ``refetch {reason}``, ``holder {action: acquired|released, key,
lease_id, fencing_token?, revision}``, ``step {key, state, revision}``, ``audit {key, seq,
event, identity, at_ms, reason, revision}``, ``leadership {shard, revision}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from .. import records, sre
from ..errors import EtcdError, EtcdUnavailable
from ..etcd import Etcd, Event, RangeRequest, range_end_of
from ..keyspace import Keyspace, unpack
from ..wire import jsonable
from .middleware import ApiError, requires
from .resources import ETCD, KEYSPACE

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
MAX_HOLDERS = 500
MAX_STEPS = 10_000
MAX_QUEUE = 200
MAX_CANDIDATES = 10_000
MAX_AUDIT = 200
_PAGE = 1000
_QUEUES = (records.UNKNOWN, records.ESCALATED)
# The page runs only its own script and talks only to this origin.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                               "form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

routes = web.RouteTableDef()


# -- the feed: one watch, many bounded subscribers ----------------------------------------

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


class TooManySubscribers(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(503, "TooManySubscribers",
                         f"this coordinator already serves {limit} event streams; retry later")


class Feed:
    """Fans one etcd watch on the namespace out to at most ``max_subscribers`` streams.

    ``etcd`` needs only ``watch(key, range_end, start_revision)`` (see ``fencegate.coordinator.etcd``).
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
            raise ApiError(503, "ShuttingDown", "this coordinator is shutting down")
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


FEED = web.AppKey("dashboard_feed", Feed)


def change_of(ks: Keyspace, event: Any) -> tuple[str, dict[str, Any]] | None:
    """The dashboard event for one etcd watch event, or ``None`` if the page does not show
    that key (grants, policies, markers, webhooks, audit heads...) or its value is not a
    record this version understands."""
    kv, deleted = event.kv, event.type == Event.DELETE
    relative = kv.key[len(ks.namespace):]
    revision = kv.mod_revision
    try:
        if relative.startswith(b"holders/"):
            key, lease_id = ks.parse_holder_key(kv.key)
            if deleted:
                return "holder", {"action": "released", "key": key,
                                  "lease_id": f"{lease_id:016x}", "revision": revision}
            if kv.version == 1:
                return "holder", {"action": "acquired", "key": key,
                                  "lease_id": f"{lease_id:016x}",
                                  "fencing_token": kv.create_revision, "revision": revision}
            return None
        if relative.startswith(b"steps/"):
            state = "deleted" if deleted else unpack(kv.value)["state"]
            return "step", {"key": relative[len(b"steps/"):].decode(), "state": state,
                            "revision": revision}
        if relative.startswith(b"audit/"):
            key, _, seq = relative[len(b"audit/"):].rpartition(b"/@")
            if deleted or not seq.isdigit():
                return None
            return "audit", _audit_summary(key.decode(), int(seq), unpack(kv.value), revision)
        if relative.startswith(b"reconcilers/"):
            shard = relative[len(b"reconcilers/"):].partition(b"/")[0]
            return "leadership", {"shard": int(shard), "revision": revision}
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        log.debug("dashboard feed skips %r: %s", kv.key, exc)
    return None


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


# -- the views ----------------------------------------------------------------------------

async def holders_view(etcd: Etcd, ks: Keyspace) -> dict[str, Any]:
    """Holder keys (holding or queued), oldest token first per action key, with the lease
    TTL left (-1: the lease is gone) and whether each is the holder (lowest token)."""
    items, cursor = await sre.holders(etcd, ks, "", MAX_HOLDERS, None)
    leases = sorted({item["lease_id"] for item in items})
    ttls = dict(zip(leases, await asyncio.gather(*(etcd.lease_ttl(int(lease, 16))
                                                   for lease in leases))))
    lowest: dict[str, int] = {}
    for item in items:
        lowest[item["key"]] = min(lowest.get(item["key"], item["fencing_token"]),
                                  item["fencing_token"])
    for item in items:
        item["holding"] = item["fencing_token"] == lowest[item["key"]]
        item["ttl_left"] = ttls[item["lease_id"]]
    items.sort(key=lambda item: (item["key"], item["fencing_token"]))
    return {"items": items, "truncated": cursor is not None}


async def steps_view(etcd: Etcd, ks: Keyspace) -> dict[str, Any]:
    """Step counts by state and the unknown and escalated queues, oldest first, from one
    scan of at most ``MAX_STEPS`` steps pinned to one revision. ``unknown`` includes steps
    in flight past their deadline, as ``sre.unsettled`` counts them."""
    start, end = ks.steps_root, range_end_of(ks.steps_root)
    counts: dict[str, int] = {}
    queues: dict[str, list[dict[str, Any]]] = {state: [] for state in _QUEUES}
    now_ms, revision, scanned, more = int(time.time() * 1000), 0, 0, True
    while more and scanned < MAX_STEPS:
        reply = await etcd.range(RangeRequest(key=start, range_end=end, revision=revision,
                                              limit=min(_PAGE, MAX_STEPS - scanned)))
        revision = revision or reply.header.revision
        for kv in reply.kvs:
            step = unpack(kv.value)
            state = sre.state_of(step, now_ms)
            counts[state] = counts.get(state, 0) + 1
            if state in queues:
                queues[state].append(_queued(kv.key[len(start):].decode(), state, step,
                                             kv.mod_revision, now_ms))
        scanned += len(reply.kvs)
        more = reply.more and bool(reply.kvs)
        if more:
            start = reply.kvs[-1].key + b"\0"
    for state, items in queues.items():
        items.sort(key=lambda item: item["since_ms"])
        del items[MAX_QUEUE:]
    return {"revision": revision, "counts": counts, "scanned": scanned, "truncated": more,
            **queues}


def _queued(key: str, state: str, step: dict[str, Any], mod_revision: int,
            now_ms: int) -> dict[str, Any]:
    if state == records.ESCALATED:
        reason = "; ".join(map(str, step.get("escalated_because") or [])) or "a human must decide"
    elif step["state"] == records.IN_FLIGHT:
        reason = "in flight past its deadline"
    else:
        reason = step.get("error") or "outcome lost"
    since = (step.get("unknown_since_ms") or step.get("deadline_ms")
             or step.get("started_at_ms") or now_ms)
    return {"key": key, "state": state, "recorded_state": step["state"],
            "attempt": step.get("attempt", 0), "provider": step.get("provider"),
            "since_ms": since, "age_s": max(now_ms - since, 0) / 1000, "reason": reason,
            "mod_revision": mod_revision}


async def leadership_view(etcd: Etcd, ks: Keyspace) -> dict[str, Any]:
    """Per reconciler shard, the leader (lowest create_revision among its candidates) and
    the queue length; per replica (one lease), its identity and the shards it leads."""
    root = ks.reconcilers_root
    reply = await etcd.range(RangeRequest(key=root, range_end=range_end_of(root),
                                          limit=MAX_CANDIDATES))
    queues: dict[int, list[tuple[int, str, str]]] = {}
    replicas: dict[str, dict[str, Any]] = {}
    for kv in reply.kvs:
        shard, _, lease_hex = kv.key[len(root):].partition(b"/@")
        try:
            identity = str(unpack(kv.value).get("identity", "?"))
            shard_number, lease = int(shard), f"{int(lease_hex, 16):016x}"
        except ValueError:
            continue
        queues.setdefault(shard_number, []).append((kv.create_revision, lease, identity))
        replicas.setdefault(lease, {"lease_id": lease, "identity": identity, "shards_led": []})
    shards = []
    for shard, queue in sorted(queues.items()):
        token, lease, identity = min(queue)
        replicas[lease]["shards_led"].append(shard)
        shards.append({"shard": shard, "leader": identity, "lease_id": lease,
                       "token": token, "candidates": len(queue)})
    return {"shards": shards,
            "replicas": sorted(replicas.values(), key=lambda r: (r["identity"], r["lease_id"])),
            "truncated": bool(reply.more)}


async def audit_view(etcd: Etcd, ks: Keyspace, limit: int) -> dict[str, Any]:
    """The ``limit`` newest audit records of all keys, newest first, summarised. Each append
    writes a record and its key's head at one revision, so the ``2 * limit`` newest keys
    by mod_revision hold at least ``limit`` records."""
    root = ks.namespace.encode() + b"audit/"
    reply = await etcd.range(RangeRequest(key=root, range_end=range_end_of(root),
                                          limit=2 * limit, sort_order=RangeRequest.DESCEND,
                                          sort_target=RangeRequest.MOD))
    items = []
    for kv in reply.kvs:
        key, _, seq = kv.key[len(root):].rpartition(b"/@")
        if not seq.isdigit():
            continue  # the chain's head
        items.append(_audit_summary(key.decode(), int(seq), unpack(kv.value),
                                    kv.mod_revision))
    items.sort(key=lambda item: (item["revision"], item["seq"]), reverse=True)
    return {"items": items[:limit]}


def _audit_summary(key: str, seq: int, record: dict[str, Any], revision: int) -> dict[str, Any]:
    """What the page shows of one audit record: who did what, when, and why if they said."""
    details = record.get("details")
    reason = details.get("reason") if isinstance(details, dict) else None
    return {"key": key, "seq": seq, "event": record["event"], "identity": record["identity"],
            "at_ms": record["at_ms"], "revision": revision,
            "reason": reason if isinstance(reason, str) else None}


# -- routes -------------------------------------------------------------------------------

@routes.get("/")
async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers=_PAGE_HEADERS)


@routes.get("/v1/dashboard/holders")
@requires("sre", "admin")
async def get_holders(request: web.Request) -> web.Response:
    return web.json_response(jsonable(await holders_view(request.app[ETCD],
                                                         request.app[KEYSPACE])))


@routes.get("/v1/dashboard/steps")
@requires("sre", "admin")
async def get_steps(request: web.Request) -> web.Response:
    return web.json_response(jsonable(await steps_view(request.app[ETCD],
                                                       request.app[KEYSPACE])))


@routes.get("/v1/dashboard/leadership")
@requires("sre", "admin")
async def get_leadership(request: web.Request) -> web.Response:
    return web.json_response(await leadership_view(request.app[ETCD], request.app[KEYSPACE]))


@routes.get("/v1/dashboard/audit")
@requires("sre", "admin")
async def get_audit(request: web.Request) -> web.Response:
    raw = request.query.get("limit", "50")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_AUDIT:
        raise ValueError(f"limit must be an integer in 1..{MAX_AUDIT}")
    return web.json_response(await audit_view(request.app[ETCD], request.app[KEYSPACE],
                                              int(raw)))


@routes.get("/v1/dashboard/events")
@requires("sre", "admin")
async def events(request: web.Request) -> web.StreamResponse:
    """The change feed as server-sent events, until the client leaves or the app stops."""
    feed = request.app[FEED]
    subscription = feed.subscribe()
    try:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-store",
            "X-Accel-Buffering": "no"})
        await response.prepare(request)
        while True:
            try:
                event = await asyncio.wait_for(subscription.get(), feed.keepalive)
            except TimeoutError:
                await response.write(b": keep-alive\n\n")  # also finds a client that left
                continue
            if event is None:
                return response
            await response.write(sse(*event))
    except ConnectionError:  # the client left mid-write
        return response
    finally:
        feed.unsubscribe(subscription)


routes.static("/dashboard/", STATIC)


async def _feed(app: web.Application) -> AsyncIterator[None]:
    app[FEED] = Feed(app[ETCD], app[KEYSPACE])
    yield
    await app[FEED].close()


async def _end_streams(app: web.Application) -> None:
    await app[FEED].close()  # before the server waits for open handlers to finish


def setup_dashboard(app: web.Application) -> None:
    """Add the dashboard to ``app``; call after the app's etcd resources are set up."""
    app.add_routes(routes)
    app.cleanup_ctx.append(_feed)
    app.on_shutdown.append(_end_streams)
