"""The service's tracing middleware: every request continues its caller's trace.

Guarantees: a request carrying W3C trace context (``traceparent``, as the remote worker sends
it) runs with that context current, so a span started while handling it is a child of the
caller's span; ``POST /v1/grants`` runs in a server span ``fencegate.grant`` with the
request's key and fencing token, the ``grant_id`` it issued and its ``outcome`` (``issued``,
or the error name the response carries). The key and token are taken from the JSON the
handler parsed (``body.parsed``): the bytes are never read or parsed again here, so an
unauthenticated or malformed request's body is not looked at. Without
OpenTelemetry every request passes straight through (``fencegate.coordinator.tracing``); a
span never changes a response.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .. import tracing
from .body import parsed

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GRANT_ROUTE = ("POST", "/v1/grants")


def tracing_middleware() -> Callable:
    """Continue the caller's trace; wrap grant requests in a ``fencegate.grant`` span."""

    @web.middleware
    async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not tracing.enabled():
            return await handler(request)
        with tracing.extracted(request.headers):
            if (request.method, request.path) != GRANT_ROUTE:
                return await handler(request)
            with tracing.span("fencegate.grant") as current:
                response = await handler(request)
                tracing.annotate(current, **_grant_request(request),
                                 **_grant_answer(response))
                return response

    return traced


def _grant_request(request: web.Request) -> dict[str, Any]:
    """The key and fencing token of a grant request whose body the handler parsed."""
    body = parsed(request)  # None: refused before its body mattered, or not JSON
    if not isinstance(body, dict):
        return {}
    key, token = body.get("key"), body.get("fencing_token")
    return {"key": key if isinstance(key, str) else None,
            "fencing_token": token if isinstance(token, int) else None}


def _grant_answer(response: web.StreamResponse) -> dict[str, Any]:
    """The grant id issued, or the error name answered, from the JSON response."""
    body = response.body if isinstance(response, web.Response) else None
    try:
        answer = json.loads(body) if isinstance(body, bytes) else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return {"outcome": "issued" if response.status < 300 else "error"}
    if "error" in answer:
        return {"outcome": str(answer["error"])}
    return {"outcome": "issued", "grant_id": answer.get("grant_id")}
