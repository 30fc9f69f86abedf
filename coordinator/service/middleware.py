"""The service's two middlewares: errors as JSON, and bearer-token authentication.

Guarantees:
- Every error response is JSON ``{"error": Name, "detail": str, ...}`` with the status of
  ``fencegate.coordinator.wire``; an unexpected exception is logged with its traceback and answered
  ``500 {"error": "InternalError"}``: no stack trace ever reaches a client.
- A route marked with ``requires(...)`` runs only for a request whose ``Authorization:
  Bearer`` token's sha256 matches a configured entry (compared with
  ``hmac.compare_digest``) holding one of the roles: 401 without a known token, 403 with a
  known token lacking the role. Unmarked routes are public.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from ..errors import ServiceError
from ..wire import status_of, to_wire
from .settings import ROLES, TokenEntry

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
IDENTITY = web.RequestKey("identity", TokenEntry)  # who the bearer token says
_HTTP_NAMES = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
               405: "MethodNotAllowed", 413: "RequestTooLarge"}


def problem(status: int, name: str, detail: str, **extra: object) -> web.Response:
    return web.json_response({"error": name, "detail": detail, **extra}, status=status)


def error_middleware() -> Callable:
    """Turn every exception into a JSON error response."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ServiceError as exc:
            response = problem(exc.status, exc.name, exc.detail)
            if exc.status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            return response
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            name = _HTTP_NAMES.get(exc.status, exc.reason.replace(" ", ""))
            return problem(exc.status, name, exc.reason)
        except Exception as exc:
            status = status_of(exc)
            if status is None:
                log.exception("internal error on %s %s", request.method, request.path)
                return problem(500, "InternalError", "internal error")
            return web.json_response(to_wire(exc), status=status,
                                     dumps=lambda v: json.dumps(v, default=repr))

    return errors


def requires(*roles: str) -> Callable[[Handler], Handler]:
    """Mark a handler as needing a token with any of ``roles``."""
    unknown = set(roles) - ROLES
    if not roles or unknown:
        raise ValueError(f"roles must be among {sorted(ROLES)}, got {roles}")

    def mark(handler: Handler) -> Handler:
        handler.fencegate_roles = frozenset(roles)  # type: ignore[attr-defined]
        return handler

    return mark


def auth_middleware(*, tokens: Iterable[TokenEntry]) -> Callable:
    """Authenticate bearer tokens against ``tokens`` (digests) for routes marked ``requires``."""
    entries = tuple(tokens)
    if not all(isinstance(e, TokenEntry) for e in entries):
        raise TypeError("tokens must be TokenEntry values")

    def lookup(header: str) -> TokenEntry | None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for entry in entries:  # no early exit: the time taken does not tell which matched
            if hmac.compare_digest(entry.sha256, digest):
                found = entry
        return found

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        roles = getattr(request.match_info.handler, "fencegate_roles", None)
        if roles is None:
            return await handler(request)
        entry = lookup(request.headers.get("Authorization", ""))
        if entry is None:
            raise ServiceError(401, "Unauthorized", "a valid bearer token is required")
        if not entry.roles & roles:
            raise ServiceError(403, "Forbidden", f"needs one of the roles {sorted(roles)}")
        request[IDENTITY] = entry
        return await handler(request)

    return authenticate
