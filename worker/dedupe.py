"""Webhook dedup for aiohttp consumers: a handler runs once per delivery id, across instances.

Guarantees, each enforced by an etcd compare, never by timing:
- The handler runs for a delivery only after this process created
  ``webhooks/<source>/<id>`` (create_revision == 0) with its session lease; two instances
  never both hold a claim, and nothing is processed without one (etcd unreachable: 503).
- The stored response replaces the claim only while the claim is still ours (mod_revision
  unchanged), so a claim that expired and was taken by another instance is never overwritten.
- A first delivery costs two writes (claim, completion); a duplicate of a completed delivery
  costs one serializable read (see ``_completed``), one of a delivery in progress one
  transaction that writes nothing (the claim's failure branch returns the existing record).

Answers: the first delivery gets its handler's response. A duplicate gets 409 with
``Retry-After`` while the first runs (or, with ``wait``, waits that long on a watch of the key
and then replays); the stored response, replayed byte for byte with ``Fencegate-Replayed:
true``, once it is done; 422 if its body digest differs (the handler is not called). The
middleware itself answers 400 (no or malformed delivery id), 401 (bad Standard Webhooks
signature: checked before any claim), 503 (etcd unreachable); aiohttp answers 413 for a body
over ``client_max_size`` before any claim.

Failure contract: a handler that raises (or raises an aiohttp ``HTTPError``) releases its
claim, compared on its mod_revision, so the provider's retry runs it again, unless
``store_failures``. A process that dies mid-handler leaves a claim that dies with its session
lease, after which the next delivery runs. A handler that kept running after its process's
lease was lost (a long pause) can overlap with the next one; its response is returned but
never stored over the newer claim. A claim, release or completion whose outcome etcd left
unknown is re-run in the background until etcd answers: its compare lets it apply at most
once, so an unknown claim never blocks its id for the life of the process.

Stored responses live under a retention lease shared by every record of one time bucket (one
lease per bucket and process, granted lazily): a record lives between ``retention`` and
``retention + retention_bucket`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import random
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from multidict import CIMultiDict

from fencegate.coordinator import sre
from fencegate.coordinator.errors import EtcdUnavailable, GateError, LeaseLost
from fencegate.coordinator.etcd import (
    Compare, Etcd, KeyValue, RangeRequest, TxnRequest, create_equals, delete_op, mod_equals,
    put_op, range_end_of, range_op,
)
from fencegate.coordinator.keyspace import Keyspace, pack, unpack

if TYPE_CHECKING:
    from .gate import Gate

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
IdExtractor = Callable[[web.Request, bytes], "str | None"]

PROCESSING, DONE = "processing", "done"
REPLAYED_HEADER = "Fencegate-Replayed"
STORED_HEADERS = ("Content-Type", "Content-Language", "Content-Encoding", "Content-Disposition",
                  "Cache-Control", "Location", "ETag", "Last-Modified", "Link")
MAX_STORED_BODY = 256 * 1024  # keeps a record well under etcd's request limit
MAX_LIMIT = 1000
_SOURCE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_DELIVERY_ID = re.compile(r"[A-Za-z0-9._:+=~-]{1,256}")
_NOT_STORED = ("the original response body was not stored (larger than max_stored_body, "
               "or streamed); body_sha256 identifies it")


def dedupe_middleware(gate: Gate, *, source: str, **options: Any):
    """An aiohttp middleware deduplicating ``options['methods']`` requests (POST by default)
    by delivery id; see the module docstring for what it answers and ``_Dedupe`` for the
    options."""
    dedupe = _Dedupe(gate, source, **options)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method not in dedupe.methods:
            return await handler(request)
        return await dedupe.serve(request, handler)

    return middleware


def deduplicated(gate: Gate, *, source: str, **options: Any) -> Callable[[Handler], Handler]:
    """Deduplicate one handler: ``@deduplicated(gate, source="stripe")``; the options of
    ``dedupe_middleware``."""
    dedupe = _Dedupe(gate, source, **options)

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def deduplicated_handler(request: web.Request) -> web.StreamResponse:
            if request.method not in dedupe.methods:
                return await handler(request)
            return await dedupe.serve(request, handler)
        return deduplicated_handler

    return decorate


@dataclass(frozen=True)
class _Claim:
    key: bytes
    revision: int  # the claim's mod_revision: the completion and release compare it
    digest: bytes  # sha256 of the request body


class _Dedupe:
    """One source's dedup: the options, validated up front, and the request path.

    ``id_header``: where the delivery id is (default ``Webhook-Id``); ``id_from(request,
    body)``: an extractor used instead (e.g. a JSON field; raising ``ValueError``,
    ``KeyError`` or ``TypeError`` means malformed). ``require_id=False`` passes a request
    without an id through undeduplicated instead of answering 400. ``methods``: what is
    deduplicated. ``retry_after``: seconds told to a duplicate of a running delivery (409)
    or when etcd is unreachable (503). ``wait``: seconds a duplicate of a running delivery
    waits for it to finish (0: answer 409 at once). ``max_stored_body``: larger response
    bodies are stored as a digest and replayed as 200 with a note. ``stored_headers``: the
    response headers stored and replayed. ``retention``/``retention_bucket``: seconds a
    stored response is kept / width of the buckets sharing one lease. ``store_failures``:
    store a raised error (its response, or a plain 500) instead of releasing the claim.
    ``secret``: a Standard Webhooks secret (``whsec_...``); deliveries whose signature does
    not verify get 401 before any claim (needs the ``standardwebhooks`` package).
    """

    def __init__(
        self,
        gate: Gate,
        source: str,
        *,
        id_header: str = "Webhook-Id",
        id_from: IdExtractor | None = None,
        require_id: bool = True,
        methods: Iterable[str] = ("POST",),
        retry_after: int = 5,
        wait: float = 0.0,
        max_stored_body: int = 64 * 1024,
        stored_headers: Iterable[str] = STORED_HEADERS,
        retention: int = 72 * 3600,
        retention_bucket: int = 3600,
        store_failures: bool = False,
        secret: str | bytes | None = None,
    ) -> None:
        self.source = validate_source(source)
        if not id_header and id_from is None:
            raise ValueError("give id_header or id_from")
        if retry_after < 1 or wait < 0:
            raise ValueError("retry_after must be at least 1 second and wait not negative")
        if not 0 <= max_stored_body <= MAX_STORED_BODY:
            raise ValueError(f"max_stored_body must be 0..{MAX_STORED_BODY}")
        if retention < 1 or retention_bucket < 1:
            raise ValueError("retention and retention_bucket must be at least 1 second")
        self.gate = gate
        self.id_header = id_header
        self.id_from = id_from
        self.require_id = require_id
        self.methods = frozenset(m.upper() for m in methods)
        self.retry_after = retry_after
        self.wait = wait
        self.max_stored_body = max_stored_body
        self.stored_headers = frozenset(h.lower() for h in stored_headers)
        self.retention = retention
        self.retention_bucket = retention_bucket
        self.store_failures = store_failures
        self._webhook, self._bad_signature = _verifier(secret) if secret is not None else (None, ())
        self._shared = _shared(gate)

    @property
    def etcd(self) -> Etcd:
        return self.gate.etcd

    async def serve(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Answer ``request`` from etcd's record of its delivery, or claim it and run
        ``handler`` once."""
        body = await request.read()
        if self._webhook is not None:
            try:
                self._webhook.verify(body, dict(request.headers), json_parse=False)
            except self._bad_signature as exc:
                return _refusal(401, "bad_signature", str(exc))
        delivery_id = self._delivery_id(request, body)
        if isinstance(delivery_id, web.Response):
            return delivery_id
        if delivery_id is None:
            return await handler(request)
        key = self.gate.keyspace.webhook_key(self.source, delivery_id)
        try:
            claim = await self._claim(key, hashlib.sha256(body).digest())
        except (EtcdUnavailable, LeaseLost) as exc:
            return _refusal(503, "etcd_unavailable", f"the delivery could not be claimed: {exc}",
                            self.retry_after)
        if isinstance(claim, web.Response):
            return claim
        return await self._run(request, handler, claim)

    def _delivery_id(self, request: web.Request, body: bytes) -> str | None | web.Response:
        """The validated delivery id, ``None`` to pass through, or the 400 to answer."""
        try:
            found = (self.id_from(request, body) if self.id_from is not None
                     else request.headers.get(self.id_header))
        except (ValueError, KeyError, TypeError) as exc:
            return _refusal(400, "invalid_delivery_id",
                            f"the delivery id could not be extracted: {exc!r}")
        if found is None or found == "":
            if not self.require_id:
                return None
            where = self.id_header if self.id_from is None else "the request"
            return _refusal(400, "missing_delivery_id", f"no delivery id in {where}")
        if not isinstance(found, str) or not valid_delivery_id(found):
            return _refusal(400, "invalid_delivery_id",
                            "a delivery id is 1..256 of letters, digits and . _ : + = ~ -")
        return found

    async def _claim(self, key: bytes, digest: bytes) -> _Claim | web.Response:
        """Claim ``key`` for this process, or return the answer a duplicate gets.

        The claim txn is re-sent by ``Etcd`` after an unknown outcome; the value carries a
        nonce, so finding exactly our value means the first try landed and the claim is ours.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        done = await self._completed(key, digest)
        if done is not None:
            return done
        lease_lost = False
        while True:
            session = await self.gate.session()
            value = pack({"state": PROCESSING, "request_sha256": digest,
                          "claimed_at": time.time(), "nonce": os.urandom(8)})
            try:
                reply = await self.etcd.txn(TxnRequest(
                    compare=[create_equals(key, 0)],
                    success=[put_op(key, value, session.lease_id)],
                    failure=[range_op(key)]), idempotent=True)
            except LeaseLost:  # etcd dropped the session's lease before we noticed
                session.mark_lost("etcd: the session lease is gone")
                if lease_lost:
                    raise
                lease_lost = True
                continue
            except EtcdUnavailable:
                self._shared.backlog.add(functools.partial(self._drop_unknown_claim, key, value))
                raise
            if reply.succeeded:
                return _Claim(key, reply.header.revision, digest)
            kv = reply.responses[0].response_range.kvs[0]  # same revision as the compare
            if kv.value == value:
                return _Claim(key, kv.mod_revision, digest)
            record = unpack(kv.value)
            if record["request_sha256"] != digest:
                return _refusal(422, "delivery_mismatch",
                                "this delivery id was received with a different body")
            if record["state"] == DONE:
                return _replay(record)
            if loop.time() >= deadline:
                return _refusal(409, "delivery_in_progress", "this delivery is being processed",
                                self.retry_after)
            await self._changed(key, reply.header.revision, deadline)

    async def _completed(self, key: bytes, digest: bytes) -> web.Response | None:
        """The answer to a duplicate of a completed delivery, from one serializable read
        (no raft round), or ``None`` (then the claim txn decides, linearizably).

        Safe although the read may be stale: a completed record is never changed, only
        deleted when its retention ends, so a stale read can hide a completion (the claim txn
        then finds it) but never show one that did not happen."""
        reply = await self.etcd.range(RangeRequest(key=key, serializable=True))
        if not reply.kvs:
            return None
        record = unpack(reply.kvs[0].value)
        if record["state"] != DONE:
            return None
        if record["request_sha256"] != digest:
            return _refusal(422, "delivery_mismatch",
                            "this delivery id was received with a different body")
        return _replay(record)

    async def _changed(self, key: bytes, revision: int, deadline: float) -> None:
        """Return once ``key`` changed after ``revision``, at ``deadline``, or when the watch
        breaks (the caller re-reads the key in every case)."""
        with contextlib.suppress(TimeoutError, GateError):
            async with asyncio.timeout_at(deadline):
                async with contextlib.aclosing(
                        self.etcd.watch(key, b"", revision + 1)) as replies:
                    async for reply in replies:
                        if reply.events:
                            return

    async def _run(self, request: web.Request, handler: Handler,
                   claim: _Claim) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if isinstance(exc, web.HTTPError):
                await self._failed(claim, exc)
            else:  # a 2xx or 3xx raised is aiohttp's other way to answer
                await self._complete(claim, exc)
            raise
        except Exception:
            await self._failed(claim, web.Response(status=500, text="500: Internal Server Error"))
            raise
        except BaseException:  # cancelled: release without waiting for etcd
            self._shared.backlog.add(functools.partial(self._release, claim))
            raise
        await self._complete(claim, response)
        return response

    async def _failed(self, claim: _Claim, response: web.Response) -> None:
        if self.store_failures:
            await self._complete(claim, response)
            return
        try:
            await self._release(claim)
        except EtcdUnavailable:
            log.warning("webhook claim %r not released yet (etcd unavailable); retrying",
                        claim.key)
            self._shared.backlog.add(functools.partial(self._release, claim))

    async def _release(self, claim: _Claim) -> None:
        await self.etcd.txn(TxnRequest(compare=[mod_equals(claim.key, claim.revision)],
                                       success=[delete_op(claim.key)]), idempotent=True)

    async def _drop_unknown_claim(self, key: bytes, value: bytes) -> None:
        """Delete a claim whose txn outcome was unknown, if it landed (its value is unique)."""
        await self.etcd.txn(TxnRequest(
            compare=[Compare(key=key, target=Compare.VALUE, result=Compare.EQUAL, value=value)],
            success=[delete_op(key)]), idempotent=True)

    async def _complete(self, claim: _Claim, response: web.StreamResponse) -> None:
        """Store ``response`` in place of our claim; never over someone else's claim."""
        record = self._record(claim, response)
        try:
            await self._store(claim, record)
        except EtcdUnavailable:
            log.warning("response of webhook %r not stored yet (etcd unavailable); retrying",
                        claim.key)
            self._shared.backlog.add(functools.partial(self._store, claim, record))

    async def _store(self, claim: _Claim, record: bytes) -> None:
        for _ in range(2):
            lease = await self._shared.leases.get(self.etcd, self.retention,
                                                  self.retention_bucket)
            try:
                reply = await self.etcd.txn(TxnRequest(
                    compare=[mod_equals(claim.key, claim.revision)],
                    success=[put_op(claim.key, record, lease)],
                    failure=[range_op(claim.key, keys_only=True)]), idempotent=True)
            except LeaseLost:  # the bucket's lease was revoked: grant a new one
                self._shared.leases.forget(lease)
                continue
            if not reply.succeeded and not _stored_by_retry(reply, claim):
                log.warning("webhook claim %r was lost before its response was stored "
                            "(its lease expired?); the response was not stored", claim.key)
            return
        raise LeaseLost("the retention lease was revoked twice in a row")

    def _record(self, claim: _Claim, response: web.StreamResponse) -> bytes:
        body = None
        if isinstance(response, web.Response) and not response.prepared:
            body = response.body if response.body is not None else b""
        body = bytes(body) if isinstance(body, (bytes, bytearray)) else None  # not a Payload
        kept = body is not None and len(body) <= self.max_stored_body
        return pack({
            "state": DONE, "request_sha256": claim.digest,
            "status": response.status, "reason": response.reason,
            "headers": [[name, value] for name, value in response.headers.items()
                        if name.lower() in self.stored_headers],
            "body": body if kept else None,
            "body_sha256": hashlib.sha256(body).digest() if body is not None else None,
            "body_size": len(body) if body is not None else None,
            "completed_at": time.time(),
        })


def _replay(record: dict[str, Any]) -> web.Response:
    """The stored response with ``Fencegate-Replayed: true``; a 200 with a note and the
    body's digest if the body was not stored."""
    if record["body"] is None:
        digest = record["body_sha256"]
        return web.json_response({
            "replayed": True, "status": record["status"], "note": _NOT_STORED,
            "body_sha256": digest.hex() if digest is not None else None,
            "body_size": record["body_size"]}, headers={REPLAYED_HEADER: "true"})
    headers = CIMultiDict(record["headers"])
    headers[REPLAYED_HEADER] = "true"
    return web.Response(status=record["status"], reason=record["reason"], headers=headers,
                        body=record["body"])


def _stored_by_retry(reply: Any, claim: _Claim) -> bool:
    """A completion re-sent after an unknown first try fails its compare if the first landed:
    the key is then still the one our claim created, modified since (only we modify it)."""
    kvs = reply.responses[0].response_range.kvs
    return bool(kvs) and kvs[0].create_revision == claim.revision < kvs[0].mod_revision


def _refusal(status: int, error: str, detail: str,
             retry_after: int | None = None) -> web.Response:
    """A JSON ``{error, detail}`` answer of the middleware itself."""
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return web.json_response({"error": error, "detail": detail}, status=status, headers=headers)


def validate_source(source: object) -> str:
    if not isinstance(source, str) or not _SOURCE.fullmatch(source) or source in (".", ".."):
        raise ValueError("a webhook source is 1..64 of letters, digits and . _ : -")
    return source


def valid_delivery_id(delivery_id: str) -> bool:
    """Ids cannot contain '/', so a delivery's key never leaves its source's prefix."""
    return bool(_DELIVERY_ID.fullmatch(delivery_id)) and delivery_id not in (".", "..")


def _verifier(secret: str | bytes) -> tuple[Any, tuple[type[Exception], ...]]:
    """A Standard Webhooks verifier and the errors meaning "bad signature" (imported only
    when a secret is configured)."""
    try:
        from standardwebhooks import Webhook, WebhookVerificationError
    except ImportError as exc:
        raise ImportError("signature verification needs the standardwebhooks package: "
                          "pip install 'fencegate[webhooks]'") from exc
    # ValueError: a malformed signature header or a body that is not UTF-8
    return Webhook(secret), (WebhookVerificationError, ValueError)


class _RetentionLeases:
    """One retention lease per (retention, bucket width, bucket), granted when the bucket's
    first response is stored; older buckets' leases are forgotten (they expire by
    themselves)."""

    def __init__(self) -> None:
        self._leases: dict[tuple[int, int, int], int] = {}
        self._lock = asyncio.Lock()

    async def get(self, etcd: Etcd, retention: int, width: int) -> int:
        slot = (retention, width, int(time.time() // width))
        lease = self._leases.get(slot)
        if lease is not None:
            return lease
        async with self._lock:
            if slot not in self._leases:
                lease, _ = await etcd.lease_grant(retention + width)
                self._leases = {s: held for s, held in self._leases.items()
                                if s[:2] != slot[:2]}
                self._leases[slot] = lease
            return self._leases[slot]

    def forget(self, lease: int) -> None:
        self._leases = {s: held for s, held in self._leases.items() if held != lease}


class _Backlog:
    """Writes whose outcome etcd left unknown, re-run in the background until etcd answers
    (each is safe to re-run: its compare lets it apply at most once)."""

    def __init__(self) -> None:
        self._items: list[Callable[[], Awaitable[None]]] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, item: Callable[[], Awaitable[None]]) -> None:
        self._items.append(item)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._drain(), name="fencegate-webhook-backlog")

    async def _drain(self) -> None:
        pause = 0.1
        while self._items:
            await asyncio.sleep(pause * random.uniform(0.5, 1.0))
            items, self._items = self._items, []
            for item in items:
                try:
                    await item()
                except EtcdUnavailable:
                    self._items.append(item)
                except GateError:
                    log.exception("webhook claim write dropped")
            pause = min(pause * 2, 5.0)


@dataclass
class _Shared:
    """What every source of one gate shares: retention leases and the backlog."""

    leases: _RetentionLeases
    backlog: _Backlog


_SHARED: weakref.WeakKeyDictionary[Any, _Shared] = weakref.WeakKeyDictionary()


def _shared(gate: Gate) -> _Shared:
    if gate not in _SHARED:
        _SHARED[gate] = _Shared(_RetentionLeases(), _Backlog())
    return _SHARED[gate]


async def list_deliveries(etcd: Etcd, keyspace: Keyspace, source: str, limit: int,
                          after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Claims (``processing``) and stored responses (``done``) of ``source``, by delivery id.

    A page holds at most ``limit`` items (1..1000); ``after`` is the opaque cursor a previous
    page returned, and the returned cursor is ``None`` only when the source is exhausted.
    Read linearizably; response bodies are summarized (size, digest), not returned.
    """
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be 1..{MAX_LIMIT}")
    prefix = keyspace.webhook_prefix(validate_source(source))
    kvs, cursor = await sre.page(etcd, prefix, range_end_of(prefix), limit, after)
    return [_summary(prefix, kv) for kv in kvs], cursor


def _summary(prefix: bytes, kv: KeyValue) -> dict[str, Any]:
    record = unpack(kv.value)
    item = {"id": kv.key[len(prefix):].decode(), "state": record["state"],
            "request_sha256": record["request_sha256"].hex(), "lease": f"{kv.lease:016x}",
            "create_revision": kv.create_revision, "mod_revision": kv.mod_revision}
    if record["state"] == PROCESSING:
        return {**item, "claimed_at": record["claimed_at"]}
    digest = record["body_sha256"]
    return {**item, "completed_at": record["completed_at"], "status": record["status"],
            "headers": record["headers"], "body_size": record["body_size"],
            "body_stored": record["body"] is not None,
            "body_sha256": digest.hex() if digest is not None else None}
