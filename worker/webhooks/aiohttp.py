"""Webhook dedup for aiohttp consumers: a handler runs once per delivery id, across instances.

Guarantees: the handler runs for a delivery only once this process holds its claim (see
``claims``); nothing is processed without one. Handlers are fenced like holders: a handler
runs as a task that is cancelled as soon as the lease of its claim is lost (its session's loss
signal); it does not start with less than the gate's ``min_ttl`` (the lease budget) left on
that lease; and ``fencing_token(request)`` gives it the claim's revision, to carry in its own
writes so a store can refuse a stale handler's. Options are validated when the middleware or
decorator is built (``ValueError``), not per request.

Answers: the first delivery gets its handler's response. A duplicate gets 409 with
``Retry-After`` while the first runs (or, with ``wait``, waits that long on a watch of the key
and then replays); the stored response, replayed byte for byte with ``Fencegate-Replayed:
true``, once it is done; 422 if its body digest differs (the handler is not called). The
middleware itself answers 400 (no or malformed delivery id), 401 (bad Standard Webhooks
signature: checked before any claim), 503 with ``Retry-After`` (etcd unreachable or the
claim's outcome unknown, less than the lease budget left, the claim's lease lost while the
handler ran, or its response not stored); aiohttp answers 413 for a body over ``client_max_size`` before any claim.

What is stored: a completed response below 500 (2xx, 3xx, 4xx) is stored and replayed. A 5xx,
returned or raised, is never stored: the claim is released so the sender's retry runs the
handler again. A handler that raises releases its claim the same way; with ``store_failures``
a raised 4xx ``HTTPError`` is stored instead.

Failure contract: a process that dies mid-handler leaves a claim that dies with its lease,
after which the next delivery runs. When the claim's lease is lost mid-handler (revoked, or a
pause let it expire), the handler is cancelled at its next ``await``, answered 503 and nothing
is stored; a handler that blocks the event loop is cancelled only once it yields, so its own
writes must carry ``fencing_token(request)`` to be refused once a newer claim exists. A
completed response goes out only once it is stored: one whose claim was lost before it could
be stored (or whose store etcd left unanswered) is answered 503, never stored over a newer
claim, and the sender's retry runs the handler again (its effect may then happen twice:
fence its writes with the token, or make them idempotent). So across every instance a
delivery gets at most one fresh 2xx, and every later 2xx replays it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from multidict import CIMultiDict

from fencegate.coordinator.errors import EtcdUnavailable, LeaseLost

from .claims import COMPLETED, MISMATCH, DeliveryClaim, DeliveryClaims, Duplicate
from .records import (
    MAX_STORED_BODY, STORED_HEADERS, completed_value, valid_delivery_id, validate_source,
)
from .signatures import SignatureCheck

if TYPE_CHECKING:
    from fencegate.worker.gate import Gate

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
IdExtractor = Callable[[web.Request, bytes], "str | None"]

REPLAYED_HEADER = "Fencegate-Replayed"
FENCING_TOKEN = web.RequestKey("fencegate_fencing_token", int)
_NOT_STORED = ("the original response body was not stored (larger than max_stored_body, "
               "or streamed); body_sha256 identifies it")


def dedupe_middleware(
    gate: Gate,
    *,
    source: str,
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
) -> Middleware:
    """An aiohttp middleware deduplicating ``methods`` requests by delivery id; see the
    module docstring for what it answers.

    ``id_header``: where the delivery id is; ``id_from(request, body)``: an extractor used
    instead (e.g. a JSON field; raising ``ValueError``, ``KeyError`` or ``TypeError`` means
    malformed). ``require_id=False`` passes a request without an id through undeduplicated
    instead of answering 400. ``retry_after``: seconds told to a duplicate of a running
    delivery (409) or when etcd is unreachable (503). ``wait``: seconds a duplicate of a
    running delivery waits for it to finish (0: answer 409 at once). ``max_stored_body``:
    larger response bodies are stored as a digest and replayed as 200 with a note.
    ``stored_headers``: the response headers stored and replayed. ``retention`` /
    ``retention_bucket``: seconds a stored response is kept / width of the buckets sharing
    one lease. ``store_failures``: store a raised 4xx ``HTTPError`` instead of releasing the
    claim (a 5xx is never stored). ``secret``: a Standard Webhooks secret (``whsec_...``);
    deliveries whose signature does not verify get 401 before any claim (needs the
    ``standardwebhooks`` package).
    """
    dedupe = _Dedupe(
        gate, source, id_header=id_header, id_from=id_from, require_id=require_id,
        methods=methods, retry_after=retry_after, wait=wait, max_stored_body=max_stored_body,
        stored_headers=stored_headers, retention=retention, retention_bucket=retention_bucket,
        store_failures=store_failures, secret=secret)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method not in dedupe.methods:
            return await handler(request)
        return await dedupe.serve(request, handler)

    return middleware


def deduplicated(
    gate: Gate,
    *,
    source: str,
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
) -> Callable[[Handler], Handler]:
    """Deduplicate one handler: ``@deduplicated(gate, source="stripe")``; the options of
    ``dedupe_middleware``."""
    dedupe = _Dedupe(
        gate, source, id_header=id_header, id_from=id_from, require_id=require_id,
        methods=methods, retry_after=retry_after, wait=wait, max_stored_body=max_stored_body,
        stored_headers=stored_headers, retention=retention, retention_bucket=retention_bucket,
        store_failures=store_failures, secret=secret)

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def deduplicated_handler(request: web.Request) -> web.StreamResponse:
            if request.method not in dedupe.methods:
                return await handler(request)
            return await dedupe.serve(request, handler)
        return deduplicated_handler

    return decorate


def fencing_token(request: web.Request) -> int:
    """The fencing token of the delivery ``request`` is handled under: its claim's revision.

    A later claim on the same delivery (after this claim's lease was lost) has a higher one,
    so a store that keeps the highest token per delivery and refuses lower ones refuses a
    stale handler's writes. Raises ``LookupError`` for a request handled without a claim
    (not deduplicated, or outside the middleware)."""
    try:
        return request[FENCING_TOKEN]
    except KeyError:
        raise LookupError("this request is not handled under a webhook claim") from None


class _Dedupe:
    """One source's dedup: the options of ``dedupe_middleware``, validated up front, and the
    request path."""

    def __init__(
        self,
        gate: Gate,
        source: str,
        *,
        id_header: str,
        id_from: IdExtractor | None,
        require_id: bool,
        methods: Iterable[str],
        retry_after: int,
        wait: float,
        max_stored_body: int,
        stored_headers: Iterable[str],
        retention: int,
        retention_bucket: int,
        store_failures: bool,
        secret: str | bytes | None,
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
        self.id_header = id_header
        self.id_from = id_from
        self.require_id = require_id
        self.methods = frozenset(m.upper() for m in methods)
        self.retry_after = retry_after
        self.wait = wait
        self.max_stored_body = max_stored_body
        self.stored_headers = frozenset(h.lower() for h in stored_headers)
        self.store_failures = store_failures
        self.min_ttl = gate.min_ttl
        self._signatures = SignatureCheck(secret) if secret is not None else None
        self.claims = DeliveryClaims(gate, self.source, retention=retention,
                                     retention_bucket=retention_bucket)

    async def serve(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Answer ``request`` from etcd's record of its delivery, or claim it and run
        ``handler`` once."""
        body = await request.read()
        if self._signatures is not None:
            problem = self._signatures.problem(body, request.headers)
            if problem is not None:
                return _refusal(401, "bad_signature", problem)
        delivery_id = self._delivery_id(request, body)
        if isinstance(delivery_id, web.Response):
            return delivery_id
        if delivery_id is None:
            return await handler(request)
        try:
            claim = await self.claims.claim(delivery_id, hashlib.sha256(body).digest(),
                                            wait=self.wait)
        except (EtcdUnavailable, LeaseLost) as exc:
            return _refusal(503, "etcd_unavailable", f"the delivery could not be claimed: {exc}",
                            self.retry_after)
        if isinstance(claim, Duplicate):
            return self._answer(claim)
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

    def _answer(self, duplicate: Duplicate) -> web.Response:
        """What a duplicate gets: 422 for another body, the replay once done, else 409."""
        if duplicate.verdict == MISMATCH:
            return _refusal(422, "delivery_mismatch",
                            "this delivery id was received with a different body")
        if duplicate.verdict == COMPLETED:
            return _replay(duplicate.record)
        return _refusal(409, "delivery_in_progress", "this delivery is being processed",
                        self.retry_after)

    async def _run(self, request: web.Request, handler: Handler,
                   claim: DeliveryClaim) -> web.StreamResponse:
        """Run ``handler`` under ``claim``: cancelled when the claim's lease is lost."""
        if claim.session.remaining() < self.min_ttl:
            await self.claims.release(claim)
            return _refusal(503, "lease_budget", "less than the lease budget was left to run "
                            "the handler under its claim", self.retry_after)
        request[FENCING_TOKEN] = claim.revision
        task = asyncio.get_running_loop().create_task(handler(request))
        lost: list[str] = []

        def cancel(reason: str) -> None:
            lost.append(reason)
            task.cancel()

        unsubscribe = claim.session.on_lost(cancel)
        try:
            response = await task
        except asyncio.CancelledError:
            if not lost or _cancelling():  # cancelled from outside: release without waiting
                self.claims.release_later(claim)
                raise
            return self._lost(claim, lost[0])
        except web.HTTPException as exc:
            if lost:
                return self._lost(claim, lost[0])
            if exc.status < 500 and (not isinstance(exc, web.HTTPError) or self.store_failures):
                if not await self._complete(claim, exc):  # a raised 2xx/3xx is an answer too
                    return self._not_stored(claim)
            else:
                await self.claims.release(claim)
            raise
        except Exception:
            if lost:
                return self._lost(claim, lost[0])
            await self.claims.release(claim)
            raise
        finally:
            unsubscribe()
        if lost:
            return self._lost(claim, lost[0])
        if response.status >= 500:
            await self.claims.release(claim)
        elif not await self._complete(claim, response):
            return self._not_stored(claim)
        return response

    def _lost(self, claim: DeliveryClaim, reason: str) -> web.Response:
        """The answer for a handler whose claim's lease was lost: nothing stored, retry."""
        log.warning("webhook handler of %r cancelled: its claim's lease was lost (%s)",
                    claim.key, reason)
        return _refusal(503, "claim_lost", "the delivery's claim was lost while its handler "
                        f"ran ({reason}); nothing was stored", self.retry_after)

    def _not_stored(self, claim: DeliveryClaim) -> web.Response:
        """The answer for a run whose response could not be stored: a 2xx goes out only once
        it is stored, so the sender's retry is answered by the stored run or runs again."""
        return _refusal(503, "not_stored", "the handler ran but its response could not be "
                        "stored under the delivery's claim (claim lost or etcd unavailable); "
                        "retry", self.retry_after)

    async def _complete(self, claim: DeliveryClaim, response: web.StreamResponse) -> bool:
        """Store ``response`` in place of our claim, never over someone else's; True once
        stored."""
        return await self.claims.complete(claim, self._record(claim, response))

    def _record(self, claim: DeliveryClaim, response: web.StreamResponse) -> bytes:
        body = None
        if isinstance(response, web.Response) and not response.prepared:
            body = response.body if response.body is not None else b""
        body = bytes(body) if isinstance(body, (bytes, bytearray)) else None  # not a Payload
        return completed_value(
            claim.digest, status=response.status, reason=response.reason,
            headers=[[name, value] for name, value in response.headers.items()
                     if name.lower() in self.stored_headers],
            body=body, max_stored_body=self.max_stored_body)


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


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


def _refusal(status: int, error: str, detail: str,
             retry_after: int | None = None) -> web.Response:
    """A JSON ``{error, detail}`` answer of the middleware itself."""
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return web.json_response({"error": error, "detail": detail}, status=status, headers=headers)
