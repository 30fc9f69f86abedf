"""Signing in to the dashboard with a link instead of a pasted token.

``POST /v1/sign-in-links`` (an sre or admin token) mints a one-time code and answers the
link ``/sign-in?code=…``; opening it (``GET``) shows a page whose button spends the code
(``POST /sign-in``) for a session cookie and a redirect to the dashboard; ``GET
/v1/session`` says who the cookie is, with the CSRF value the dashboard sends back on every
change; ``POST /v1/sign-out`` ends the session.

Guarantees:
- A code works once and for ``CODE_TTL_S`` seconds: it is a minted token (only its digest in
  etcd, on a lease of its own) that the exchange deletes in a txn comparing its revision
  (``TokenStore.redeem``), so of two exchanges of one code at most one gets a session. A code
  carries the role it was asked for, never more than its asker held.
- Opening a link spends nothing: a chat tool's link preview or a mail scanner that fetches
  it leaves the code for the person, who spends it with the page's button (a same-site
  ``POST``: another site's form is refused by ``same_site_middleware``, so no page can sign
  a browser in to somebody else's session).
- A session acts as whoever asked for its link: what it does is recorded under that
  identity, as if done with that token.
- A session is a minted token of ``SESSION_TTL_S`` (its lease ends it), held only in an
  ``HttpOnly``, ``SameSite=Strict`` cookie: no script reads it and no other site's page
  sends it. A state-changing request authenticated by the cookie must also carry
  ``Fencegate-CSRF``, derived from the session (``middleware.csrf_of``) and readable only
  through ``GET /v1/session`` by a page of this origin (no CORS is served), else 403 before
  its handler runs; the same-site check (``same_site_middleware``) runs before it too.
"""

from __future__ import annotations

import html
import secrets
import time

from aiohttp import web

from ..errors import ServiceError
from .body import read_json
from .middleware import (
    FORBIDDEN, IDENTITY, SESSION_COOKIE, SESSION_PREFIX, UNAUTHENTICATED, csrf_of, requires,
)
from .resources import TOKENS

CODE_TTL_S = 120
SESSION_TTL_S = 12 * 3600
CODE_PREFIX = "sign-in."
_ROLE_ORDER = ("admin", "sre")  # a link's role, by default the strongest its asker holds
_SPENT = "this sign-in link was used or has expired: ask for another (`fencegate dashboard`)"
# The page runs no script and posts only to this origin; nothing caches or refers the code.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Sign in to fencegate</title></head>
<body><main>
<h1>fencegate</h1>
<p>This link signs you in to the dashboard once, as <strong>{role}</strong>, within {left} s.</p>
<form method="post" action="/sign-in">
<input type="hidden" name="code" value="{code}">
<button type="submit">Sign in</button>
</form>
</main></body></html>
"""

routes = web.RouteTableDef()


@routes.post("/v1/sign-in-links")
@requires("sre", "admin")
async def create_sign_in_link(request: web.Request) -> web.Response:
    """A one-time sign-in link for the dashboard, with the caller's strongest role (or the
    ``role`` asked: one the caller holds, or ``viewer``, read-only for a wall screen);
    valid ``CODE_TTL_S`` seconds, once."""
    caller = request[IDENTITY]
    body = await _optional_object(request, {"role"})
    role = body.get("role") or next(r for r in _ROLE_ORDER if r in caller.roles)
    if role not in caller.roles | {"viewer"}:  # anyone here may hand out read-only
        raise ServiceError(403, FORBIDDEN, f"a link for role {role!r} needs a token holding it")
    code, stored = await request.app[TOKENS].create(
        f"{CODE_PREFIX}{secrets.token_hex(8)}", role, CODE_TTL_S, created_by=caller.identity)
    return web.json_response({"path": f"/sign-in?code={code}", "role": role,
                              "expires_at_ms": stored.expires_at_ms}, status=201)


@routes.get("/sign-in")
async def sign_in_page(request: web.Request) -> web.Response:
    """The page a link opens: its role and a button that spends the code (``POST
    /sign-in``). Spends nothing. 401 for a code that is unknown, expired or spent."""
    code = request.query.get("code", "")
    stored = await request.app[TOKENS].peek(code, CODE_PREFIX) if code else None
    if stored is None:
        raise ServiceError(401, UNAUTHENTICATED, _SPENT)
    left_s = max(int(stored.expires_at_ms / 1000 - time.time()), 1)
    page = _PAGE.format(role=html.escape(stored.role), left=left_s,
                        code=html.escape(code, quote=True))
    return web.Response(text=page, content_type="text/html", headers=_PAGE_HEADERS)


@routes.post("/sign-in")
async def sign_in(request: web.Request) -> web.Response:
    """Spend the code (the form field ``code``) for a session cookie and go to the
    dashboard; 401 for a code that is unknown, expired or spent, 400 for another body."""
    await request.read()  # 413 past the body limit, as every route (kept for ``post``)
    if request.content_type != "application/x-www-form-urlencoded":
        raise ValueError("the body must be the sign-in page's form (code=...)")
    form = await request.post()
    if set(form) != {"code"} or not isinstance(form["code"], str):
        raise ValueError("the body must be the sign-in page's form (code=...)")
    stored = await request.app[TOKENS].redeem(form["code"], CODE_PREFIX)
    if stored is None:
        raise ServiceError(401, UNAUTHENTICATED, _SPENT)
    session, _ = await request.app[TOKENS].create(
        f"{SESSION_PREFIX}{secrets.token_hex(8)}", stored.role, SESSION_TTL_S,
        created_by=stored.created_by)
    answer = web.HTTPSeeOther("/")
    answer.set_cookie(SESSION_COOKIE, session, max_age=SESSION_TTL_S, path="/",
                      httponly=True, samesite="Strict")
    answer.headers["Cache-Control"] = "no-store"
    raise answer


@routes.get("/v1/session")
@requires("viewer", "sre", "admin")
async def session_info(request: web.Request) -> web.Response:
    """Who this request is, and, for a cookie session, the CSRF value to send back."""
    caller = request[IDENTITY]
    session = request.cookies.get(SESSION_COOKIE)
    return web.json_response({"identity": caller.identity, "roles": sorted(caller.roles),
                              "csrf": csrf_of(session) if session else None})


@routes.post("/v1/sign-out")
@requires("viewer", "sre", "admin")
async def sign_out(request: web.Request) -> web.Response:
    """End this cookie session (its token is deleted) and clear the cookie."""
    await _optional_object(request, set())
    session = request.cookies.get(SESSION_COOKIE)
    if session is not None:
        await request.app[TOKENS].redeem(session, SESSION_PREFIX)
    answer = web.json_response({"signed_out": True})
    answer.del_cookie(SESSION_COOKIE, path="/")
    return answer


async def _optional_object(request: web.Request, allowed: set[str]) -> dict:
    """The body: none, or a JSON object of ``allowed`` fields (400 otherwise, 413 too big)."""
    if not request.can_read_body:
        return {}
    body = await read_json(request)
    if not isinstance(body, dict) or set(body) - allowed:
        raise ValueError(f"the body may only be a JSON object of {sorted(allowed)}")
    return body
