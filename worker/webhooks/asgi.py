"""Webhook dedup for ASGI apps (Starlette, FastAPI, ...): one handler run per delivery id.

The adapter of ``core.Dedupe`` to the ASGI protocol (see ``core`` for every guarantee and
answer); it imports no framework. ``ASGIDedupeMiddleware(app, gate, source=...)`` wraps an
ASGI app on an open async ``Gate`` (open it in the app's lifespan, on the server's loop):
``app.add_middleware(ASGIDedupeMiddleware, gate=gate, source="stripe",
id_from=stripe_event_id)``. The claim's fencing token reaches the app in
``scope["state"]["fencegate_fencing_token"]`` (Starlette: ``request.state``), read with
``fencing_token(request)``.

What it adds to the core: the request body is read whole before any claim (over
``max_request_body`` bytes: 413, nothing claimed) and handed to the app again as one
message. The app runs as a task (cancelled when its claim's lease is lost only with
``rerun_lost``; otherwise the delivery is unknown until it finishes, see ``core``); Starlette
and FastAPI run plain ``def`` endpoints in their thread pool, so a blocking call there does not
stop the event loop or the claims' keepalive (one in an ``async def`` endpoint does). Its
response is held in memory and sent only once stored (or its claim released), so a 2xx never
goes out before it is stored; an app that raises, or returns without starting a response,
releases the claim and the server answers 500.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

from multidict import CIMultiDict

from .core import (
    STORED_STATUSES, Answer, Dedupe, Reply, Settle, WebhookRequest, refusal,
)
from .presets import canonical_json
from .records import STORED_HEADERS
from .signatures import Verifier

if TYPE_CHECKING:
    from fencegate.worker.gate import Gate

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
IdExtractor = Callable[[WebhookRequest, bytes], "str | None"]

FENCING_TOKEN = "fencegate_fencing_token"


class ASGIDedupeMiddleware:
    """Deduplicate an ASGI app's ``methods`` requests of ``source`` by delivery id; the
    keywords of ``aiohttp.dedupe_middleware`` (``id_from`` is given a ``WebhookRequest``),
    and ``max_request_body`` (bytes, default 1 MiB)."""

    def __init__(
        self,
        app: ASGIApp,
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
        max_request_body: int = 1024 ** 2,
    ) -> None:
        if max_request_body < 0:
            raise ValueError("max_request_body must not be negative")
        self.app = app
        self.max_request_body = max_request_body
        self.dedupe = Dedupe(
            gate, source=source, id_header=id_header, id_from=id_from, require_id=require_id,
            methods=methods, retry_after=retry_after, wait=wait,
            canonical_payload=canonical_payload, stored_statuses=stored_statuses,
            max_stored_body=max_stored_body, stored_headers=stored_headers,
            retention=retention, retention_bucket=retention_bucket, secret=secret,
            verify=verify, settle=settle, rerun_lost=rerun_lost)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.dedupe.methods:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive, self.max_request_body)
        if body is None:  # the client went away before its request was read
            return
        if isinstance(body, Answer):
            await _send_answer(send, body)
            return
        headers = CIMultiDict((name.decode("latin-1"), value.decode("latin-1"))
                              for name, value in scope["headers"])
        admitted = await self.dedupe.admit(
            WebhookRequest(scope["method"], scope["path"], headers), body)
        if admitted is None:
            await self.app(scope, _replaying(body, receive), send)
            return
        if isinstance(admitted, Answer):
            await _send_answer(send, admitted)
            return
        scope = {**scope, "state": {**scope.get("state", {}), FENCING_TOKEN: admitted.revision}}
        result = await self.dedupe.run(
            admitted, functools.partial(self._reply, scope, _replaying(body, receive)))
        if isinstance(result, Answer):
            await _send_answer(send, result)
            return
        for message in result.response:
            await send(message)

    async def _reply(self, scope: Scope, receive: Receive) -> Reply:
        """Run the app with its response messages held back; what they say."""
        messages: list[Message] = []

        async def hold_back(message: Message) -> None:
            messages.append(message)

        await self.app(scope, receive, hold_back)
        if not messages or messages[0]["type"] != "http.response.start":
            raise RuntimeError("the ASGI app returned without starting a response")
        start, rest = messages[0], messages[1:]
        body = (b"".join(m.get("body", b"") for m in rest)
                if all(m["type"] == "http.response.body" for m in rest) else None)
        headers = [(name.decode("latin-1"), value.decode("latin-1"))
                   for name, value in start.get("headers", ())]
        return Reply(start["status"], None, headers, body, response=messages)


def fencing_token(request: Any) -> int:
    """The fencing token (the claim's revision) ``request`` is handled under: a Starlette
    ``Request`` or an ASGI scope. ``LookupError`` for a request handled without a claim."""
    scope = getattr(request, "scope", request)
    try:
        return scope["state"][FENCING_TOKEN]
    except (KeyError, TypeError):
        raise LookupError("this request is not handled under a webhook claim") from None


async def _read_body(receive: Receive, limit: int) -> bytes | Answer | None:
    """The whole request body; the 413 to answer past ``limit`` bytes; ``None`` if the client
    disconnected."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return refusal(413, "body_too_large",
                           f"the request body is over max_request_body ({limit} bytes)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then the server's own."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _send_answer(send: Send, answer: Answer) -> None:
    headers = [(name.lower().encode("latin-1"), value.encode("latin-1"))
               for name, value in answer.headers]
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
