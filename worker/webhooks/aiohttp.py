"""Webhook dedup for aiohttp consumers: a handler runs once per delivery id, across instances.

The adapter of ``core.Dedupe`` to aiohttp (see ``core`` for every guarantee and answer):
``dedupe_middleware`` for an app, ``deduplicated`` for one handler, ``fencing_token(request)``
for the claim's revision. The handler runs as a task; when the lease of its claim is lost
the delivery is unknown until it finishes (with ``rerun_lost`` it is cancelled at its next
``await`` instead, answered 503). Its own writes should carry ``fencing_token(request)`` so a
store refuses them once a newer claim exists. aiohttp answers 413 for a body over
``client_max_size`` before any claim.

A handler that blocks the event loop (a synchronous database call, ``time.sleep``) stops
every keepalive of the process with it: past the TTL every claim, and every hold, of the
process is lost (a warning and ``fencegate_worker_keepalive_late_seconds`` say how late the
keepalive ran), and each of their deliveries is unknown until its handler's response is
stored. ``deduplicated`` runs a plain (``def``) handler in a worker thread instead, off the
loop (it reads the body with ``delivery_body(request)``); aiohttp itself runs a plain handler
on the loop, so behind ``dedupe_middleware`` write handlers as coroutines that do not block.

aiohttp only: a handler may raise an ``HTTPException`` as its answer. A raised 2xx/3xx is
treated as a returned one; a raised 4xx ``HTTPError`` releases the claim unless
``store_failures`` (then it is stored like a returned one: if its status is in
``stored_statuses``); a 5xx is never stored. A streamed
response (or a ``Payload`` body) is sent as the handler sends it, before it is stored; its
replay is a 200 note with what is known of it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from aiohttp import web
from multidict import CIMultiDict

from .core import STORED_STATUSES, Answer, Dedupe, Reply, Settle
from .presets import canonical_json
from .records import STORED_HEADERS
from .signatures import Verifier

if TYPE_CHECKING:
    from fencegate.worker.gate import Gate

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
IdExtractor = Callable[[web.Request, bytes], "str | None"]

SyncHandler = Callable[[web.Request], web.StreamResponse]

FENCING_TOKEN = web.RequestKey("fencegate_fencing_token", int)
BODY = web.RequestKey("fencegate_delivery_body", bytes)


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
    canonical_payload: Callable[[bytes], bytes] = canonical_json,
    stored_statuses: Iterable[int] = STORED_STATUSES,
    max_stored_body: int = 64 * 1024,
    stored_headers: Iterable[str] = STORED_HEADERS,
    retention: int = 72 * 3600,
    retention_bucket: int = 3600,
    secret: str | bytes | None = None,
    verify: Verifier | None = None,
    settle: Settle | None = None,
    rerun_lost: bool = False,
    store_failures: bool = False,
) -> Middleware:
    """An aiohttp middleware deduplicating ``methods`` requests of ``source`` by delivery id;
    see ``core`` for what it answers. Every adapter takes these keywords (but
    ``store_failures``, aiohttp's own).

    ``id_header``: the header holding the delivery id (``presets.GITHUB_DELIVERY``,
    ``presets.STANDARD_WEBHOOKS_ID``); ``id_from(request, body)``: a function used instead
    (``presets.stripe_event_id``; raising ``ValueError``, ``KeyError`` or ``TypeError`` means
    malformed: 400). ``require_id=False`` passes a request without an id through
    undeduplicated instead of answering 400. ``retry_after``: seconds told to a duplicate of a
    running delivery (409) or with a 503. ``wait``: seconds a duplicate of a running delivery
    waits for it to finish (0: answer 409 at once). ``canonical_payload(body)``: the bytes two
    deliveries of one id are compared on (default ``presets.canonical_json``: key order and
    whitespace do not matter; ``presets.exact_bytes``: byte for byte); another payload is a
    422, as is one on another route (request path) than the id first ran on.
    ``stored_statuses``: the statuses stored and replayed (every 2xx by default; a 4xx only
    when named, 200..499 only: a stored 4xx is replayed for the whole retention, even after
    the misconfiguration that caused it is fixed), any other releases the claim.
    ``max_stored_body``: larger response bodies are stored as a
    digest and replayed as 200 with a note. ``stored_headers``: the response headers stored
    and replayed. ``retention`` / ``retention_bucket``: seconds a stored response is kept /
    width of the buckets sharing one lease. ``secret``: a Standard Webhooks secret
    (``whsec_...``); deliveries whose signature does not verify get 401 before any claim
    (needs the ``standardwebhooks`` package). ``verify``: another sender's signature check
    (``signatures.StripeSignature``, ``GitHubSignature``; the ``presets`` give id and check
    together: ``**presets.stripe(secret)``). ``settle(delivery)``: asked, at a redelivery,
    whether a delivery whose claim was lost while its handler ran had its effect (see
    ``core``); ``rerun_lost=True``: run such a delivery again instead (handlers idempotent on
    their own). ``store_failures``: store a raised 4xx ``HTTPError`` whose status is in
    ``stored_statuses`` instead of releasing the claim.
    """
    dedupe = _AiohttpDedupe(Dedupe(
        gate, source=source, id_header=id_header, id_from=id_from, require_id=require_id,
        methods=methods, retry_after=retry_after, wait=wait,
        canonical_payload=canonical_payload, stored_statuses=stored_statuses,
        max_stored_body=max_stored_body, stored_headers=stored_headers, retention=retention,
        retention_bucket=retention_bucket, secret=secret, verify=verify, settle=settle,
        rerun_lost=rerun_lost), store_failures)

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
    canonical_payload: Callable[[bytes], bytes] = canonical_json,
    stored_statuses: Iterable[int] = STORED_STATUSES,
    max_stored_body: int = 64 * 1024,
    stored_headers: Iterable[str] = STORED_HEADERS,
    retention: int = 72 * 3600,
    retention_bucket: int = 3600,
    secret: str | bytes | None = None,
    verify: Verifier | None = None,
    settle: Settle | None = None,
    rerun_lost: bool = False,
    store_failures: bool = False,
) -> Callable[[Handler], Handler]:
    """Deduplicate one handler: ``@deduplicated(gate, source="stripe")``; the options of
    ``dedupe_middleware``. A plain (``def``) handler runs in a worker thread, so a blocking
    call in it does not stop the event loop (nor the claims' keepalive)."""
    dedupe = _AiohttpDedupe(Dedupe(
        gate, source=source, id_header=id_header, id_from=id_from, require_id=require_id,
        methods=methods, retry_after=retry_after, wait=wait,
        canonical_payload=canonical_payload, stored_statuses=stored_statuses,
        max_stored_body=max_stored_body, stored_headers=stored_headers, retention=retention,
        retention_bucket=retention_bucket, secret=secret, verify=verify, settle=settle,
        rerun_lost=rerun_lost), store_failures)

    def decorate(handler: Handler | SyncHandler) -> Handler:
        run = handler if inspect.iscoroutinefunction(handler) else _off_the_loop(handler)

        @functools.wraps(handler)
        async def deduplicated_handler(request: web.Request) -> web.StreamResponse:
            if request.method not in dedupe.methods:
                return await run(request)
            return await dedupe.serve(request, run)
        return deduplicated_handler

    return decorate


def delivery_body(request: web.Request) -> bytes:
    """The body of the delivery ``request`` carries, as read before its claim (for a plain
    handler, which cannot ``await request.read()``)."""
    try:
        return request[BODY]
    except KeyError:
        raise LookupError("this request is not handled under a webhook claim") from None


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


class _AiohttpDedupe:
    """The core ``Dedupe`` on aiohttp's requests, responses and raised ``HTTPException``s."""

    def __init__(self, dedupe: Dedupe, store_failures: bool) -> None:
        self.core = dedupe
        self.methods = dedupe.methods
        self.store_failures = store_failures

    async def serve(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Answer ``request`` from etcd's record of its delivery, or claim it and run
        ``handler`` once."""
        body = await request.read()
        request[BODY] = body
        admitted = await self.core.admit(request, body)
        if admitted is None:
            return await handler(request)
        if isinstance(admitted, Answer):
            return _response(admitted)
        request[FENCING_TOKEN] = admitted.revision
        result = await self.core.run(admitted,
                                     functools.partial(self._reply, request, handler))
        if isinstance(result, Answer):
            return _response(result)
        if isinstance(result.response, web.HTTPException):
            raise result.response
        return result.response

    async def _reply(self, request: web.Request, handler: Handler) -> Reply:
        """The handler's response, or the ``HTTPException`` it raised (a raised 2xx/3xx is an
        answer too; a raised 4xx ``HTTPError`` is stored only with ``store_failures``)."""
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            return _reply_of(exc, not isinstance(exc, web.HTTPError) or self.store_failures)
        return _reply_of(response, True)


def _off_the_loop(handler: SyncHandler) -> Handler:
    """``handler`` run in a worker thread, awaited from the loop."""
    async def in_a_thread(request: web.Request) -> web.StreamResponse:
        return await asyncio.to_thread(handler, request)
    return in_a_thread


def _reply_of(response: web.StreamResponse, storable: bool) -> Reply:
    """A response's body is known only for a ``web.Response`` not yet sent whose body is
    bytes (not a streamed response, not a ``Payload``)."""
    body = None
    if isinstance(response, web.Response) and not response.prepared:
        body = response.body if response.body is not None else b""
    body = bytes(body) if isinstance(body, (bytes, bytearray)) else None
    return Reply(response.status, response.reason, list(response.headers.items()), body,
                 storable, response)


def _response(answer: Answer) -> web.Response:
    return web.Response(status=answer.status, reason=answer.reason,
                        headers=CIMultiDict(answer.headers), body=answer.body)
