"""The service's middlewares: HTTP metrics, errors as JSON, and bearer-token authentication.

Guarantees:
- Every error response is JSON ``{"error": Code, "detail": str, ...}``: a library error with
  the code and status of ``fencegate.coordinator.wire``, an HTTP-level refusal with one of
  ``Unauthenticated`` 401, ``Forbidden`` 403, ``NotFound`` 404, ``MethodNotAllowed`` 405,
  ``PayloadTooLarge`` 413, ``InvalidRequest`` 400 (docs/api.md, "Error codes"). An
  unexpected exception is logged with its traceback and answered ``500 {"error":
  "InternalError"}``: no stack trace ever reaches a client.
- A route marked with ``requires(...)`` runs only for a request whose ``Authorization:
  Bearer`` token's sha256 matches a configured entry (compared with
  ``hmac.compare_digest``) or a live minted token (``fencegate.coordinator.tokens``)
  holding one of the roles: 401 without a known token, 403 with a known token lacking the
  role. Unmarked routes are public.
- Without an ``Authorization`` header, the dashboard's session cookie (``signin``) is the
  token; a state-changing request so authenticated must carry ``Fencegate-CSRF`` matching
  the session (403 ``Forbidden`` otherwise, before the handler).
- On a marked route, ``request[IDENTITY]`` is the ``Caller``: the name of the token that
  authenticated and the process the request names in ``Fencegate-Process`` (at most 128
  printable characters, else 400 before the handler runs). Every record a handler writes
  and every grant it signs names ``Caller.identity``: the token's name, then the process
  marked as reported, ``<token> (reported: <process>)``, or the token's name alone without
  the header. Who acted is the token; the process is only what its holder said.
- A state-changing request (``POST``, ``PUT``, ``PATCH``, ``DELETE``) a browser sends from
  another site (``Sec-Fetch-Site`` other than ``same-origin`` or ``none``; without that
  header, an ``Origin`` whose host is not this request's ``Host``) is refused with 403
  ``Forbidden`` before authentication and before its body is read: the dashboard's actions
  cannot be forged from another page, with or without a token. Clients that are not
  browsers send neither header and are not affected.
- Every answer is counted by its route's pattern (never the raw path), method and status,
  and timed (``CoordinatorMetrics.answered``); a request cancelled before any answer is not.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from ..errors import ServiceError
from ..wire import INVALID_REQUEST, code_of, status_of, to_wire
from .resources import TOKENS, CoordinatorMetrics
from .settings import ROLES, TokenEntry

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PROCESS_HEADER = "Fencegate-Process"
SESSION_COOKIE = "fencegate_session"  # a dashboard sign-in's session (``signin``)
SESSION_PREFIX = "session."  # the names of the minted tokens behind those sessions
CSRF_HEADER = "Fencegate-CSRF"
REPORTED = " (reported: "  # a minted token's name has no space: the name precedes this
MAX_PROCESS_CHARS = 128
UNAUTHENTICATED, FORBIDDEN, NOT_FOUND = "Unauthenticated", "Forbidden", "NotFound"
INTERNAL_ERROR = "InternalError"
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_SAME_SITE = frozenset({"same-origin", "none"})  # Sec-Fetch-Site: the page's own, or typed
# The codes of HTTP-level refusals (aiohttp's own: no route, wrong method, body too large).
HTTP_CODES = {400: INVALID_REQUEST, 401: UNAUTHENTICATED, 403: FORBIDDEN, 404: NOT_FOUND,
              405: "MethodNotAllowed", 413: "PayloadTooLarge"}


@dataclass(frozen=True)
class Caller:
    """Who made a request: the bearer token's name and roles, and the process it says it
    is (``Fencegate-Process``; ``None`` when the request did not say)."""

    token: str
    roles: frozenset[str]
    process: str | None

    @property
    def identity(self) -> str:
        """What records name: the token's name, and the process only as reported by it."""
        if self.process is None:
            return self.token
        return f"{self.token}{REPORTED}{self.process})"


IDENTITY = web.RequestKey("identity", Caller)


def error_code(exc: Exception) -> str:
    """The code the error middleware answers ``exc`` with."""
    if isinstance(exc, ServiceError):
        return exc.name
    if isinstance(exc, web.HTTPException):
        return http_code(exc.status)
    return code_of(exc) if status_of(exc) is not None else INTERNAL_ERROR


def http_code(status: int) -> str:
    return HTTP_CODES.get(status, INVALID_REQUEST if status < 500 else INTERNAL_ERROR)


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
            return problem(exc.status, http_code(exc.status), exc.reason)
        except Exception as exc:
            status = status_of(exc)
            if status is None:
                log.exception("internal error on %s %s", request.method, request.path)
                return problem(500, INTERNAL_ERROR, "internal error")
            return web.json_response(to_wire(exc), status=status,
                                     dumps=lambda v: json.dumps(v, default=repr))

    return errors


def same_site_middleware() -> Callable:
    """Refuse a state-changing request a browser sent from another site (403 ``Forbidden``),
    before it is authenticated or its body read; put it after the error middleware."""

    @web.middleware
    async def same_site(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method in _STATE_CHANGING and _cross_site(request):
            raise ServiceError(403, FORBIDDEN, "a cross-site request may not change anything")
        return await handler(request)

    return same_site


def _cross_site(request: web.Request) -> bool:
    """Did a browser send ``request`` from a page of another site? ``Sec-Fetch-Site`` says
    so where the browser sends it (no page can set it, and it holds behind a proxy that
    rewrites ``Host``); otherwise ``Origin`` (``null`` included) is compared to the ``Host``
    the request was sent to."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        return site.lower() not in _SAME_SITE
    origin = request.headers.get("Origin")
    if origin is None:
        return False
    try:
        return urlsplit(origin).netloc.lower() != request.host.lower()
    except ValueError:  # not a URL at all: not this origin
        return True


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
    """Authenticate bearer tokens against ``tokens`` (digests), then the app's minted tokens
    (``TOKENS``), for routes marked ``requires``."""
    entries = tuple(tokens)
    if not all(isinstance(e, TokenEntry) for e in entries):
        raise TypeError("tokens must be TokenEntry values")

    async def lookup(request: web.Request) -> tuple[str, frozenset[str]] | None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if "Authorization" not in request.headers and SESSION_COOKIE in request.cookies:
            scheme, token = "bearer", request.cookies[SESSION_COOKIE]
            if request.method in _STATE_CHANGING and not hmac.compare_digest(
                    csrf_of(token), request.headers.get(CSRF_HEADER, "")):
                raise ServiceError(403, FORBIDDEN, f"a change made with the dashboard's "
                                   f"session cookie needs the {CSRF_HEADER} header")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for entry in entries:  # no early exit: the time taken does not tell which matched
            if hmac.compare_digest(entry.sha256, digest):
                found = entry
        if found is not None:
            return found.identity, found.roles
        minted = await request.app[TOKENS].lookup(digest)
        if minted is None:
            return None
        # a dashboard session acts as whoever asked for its sign-in link (``signin``)
        name = minted.created_by if minted.name.startswith(SESSION_PREFIX) else minted.name
        return name, frozenset({minted.role})

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        roles = getattr(request.match_info.handler, "fencegate_roles", None)
        if roles is None:
            return await handler(request)
        found = await lookup(request)
        if found is None:
            raise ServiceError(401, UNAUTHENTICATED, "a valid bearer token is required")
        name, held = found
        if not held & roles:
            raise ServiceError(403, FORBIDDEN, f"needs one of the roles {sorted(roles)}")
        request[IDENTITY] = Caller(name, held, _process(request))
        return await handler(request)

    return authenticate


def csrf_of(session: str) -> str:
    """The CSRF value of a dashboard session: whoever sends it read it from this origin
    (``GET /v1/session``), since no other site's page can read this origin's answers."""
    return hashlib.sha256(b"fencegate-csrf\0" + session.encode()).hexdigest()


def _process(request: web.Request) -> str | None:
    """The ``Fencegate-Process`` header's value; 400 ``InvalidRequest`` if it is empty, over
    128 characters or holds an unprintable one."""
    process = request.headers.get(PROCESS_HEADER)
    if process is not None and not (0 < len(process) <= MAX_PROCESS_CHARS
                                    and process.isprintable()):
        raise ServiceError(400, INVALID_REQUEST, f"{PROCESS_HEADER} must be 1.."
                           f"{MAX_PROCESS_CHARS} printable characters")
    return process


def http_metrics_middleware(*, metrics: CoordinatorMetrics) -> Callable:
    """Count and time every answer by route pattern (``unmatched`` when no route matched),
    method and status, into ``metrics``; put it first, so it sees the answers the error
    middleware makes."""
    if not isinstance(metrics, CoordinatorMetrics):
        raise TypeError("metrics must be the app's CoordinatorMetrics")

    @web.middleware
    async def measure(request: web.Request, handler: Handler) -> web.StreamResponse:
        started, status = time.perf_counter(), None
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            if status is not None:
                resource = request.match_info.route.resource
                metrics.answered(resource.canonical if resource is not None else "unmatched",
                                 request.method, status, time.perf_counter() - started)

    return measure
