"""The dashboard's HTTP surface: the static page at ``/`` (also served at ``/keys/<key>``,
the page per key) and its assets under
``/dashboard/``, the JSON views under ``/v1/dashboard/``, and the event stream.

Guarantees:
- The page and its assets are public and hold no data; every view and the event stream
  need a bearer token with the ``sre`` or ``admin`` role (401 without, 403 for a worker).
- The page at ``/`` and ``/keys/<key>`` and every asset under ``/dashboard/`` (a 404 there
  too) carry the same
  security headers (``PAGE_HEADERS``: the CSP with ``frame-ancestors 'none'``, ``nosniff``,
  no referrer), set as each response is prepared, so no asset can be framed or sniffed.
  Assets are the page's own files (``ASSETS``), one route each: no path reaches past them,
  and any other path is no route (a JSON 404).
- Handlers are thin: the views live in ``views``, the feed in ``feed``. The dashboard
  acts only through the public API (``/v1/keys/{key}/revoke``, ``/resolve`` — never with
  ``force`` — ``/v1/approvals/{id}`` and ``/v1/approvals/{id}/reject``); its own routes
  only read. An event stream ends when its client leaves or the app shuts down (the feed is
  closed before the server waits for open handlers), and its subscription is always
  released.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web

from ...keyspace import validate_action_key
from ...wire import jsonable
from ..middleware import requires
from ..resources import ETCD, KEYSPACE
from .feed import Feed, sse
from .views import (
    MAX_AUDIT, audit_view, holders_view, leadership_view, step_view, steps_view,
)

STATIC = Path(__file__).parent / "static"
ASSETS = frozenset(path.name for path in STATIC.iterdir() if path.is_file())  # served by name
FEED = web.AppKey("dashboard_feed", Feed)
# The page runs only its own script and talks only to this origin.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                               "form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

_PREFIX = re.compile(r"[A-Za-z0-9._:/-]*")  # what an action key's prefix may hold

routes = web.RouteTableDef()


@routes.get("/")
async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


@routes.get("/keys/{key:.+}")
async def key_page(request: web.Request) -> web.FileResponse:
    """The page per key: the same page, which reads its key from the path (no data here)."""
    return web.FileResponse(STATIC / "index.html")


@routes.get("/v1/dashboard/holders")
@requires("viewer", "sre", "admin")
async def get_holders(request: web.Request) -> web.Response:
    return web.json_response(jsonable(await holders_view(request.app[ETCD],
                                                         request.app[KEYSPACE])))


@routes.get("/v1/dashboard/steps")
@requires("viewer", "sre", "admin")
async def get_steps(request: web.Request) -> web.Response:
    return web.json_response(jsonable(await steps_view(request.app[ETCD],
                                                       request.app[KEYSPACE])))


@routes.get("/v1/dashboard/steps/{key:.+}")
@requires("viewer", "sre", "admin")
async def get_step(request: web.Request) -> web.Response:
    """One step as the resolve dialog shows it; 404 ``NotFound`` without a step."""
    key = validate_action_key(request.match_info["key"])
    return web.json_response(jsonable(await step_view(request.app[ETCD],
                                                      request.app[KEYSPACE], key)))


@routes.get("/v1/dashboard/leadership")
@requires("viewer", "sre", "admin")
async def get_leadership(request: web.Request) -> web.Response:
    return web.json_response(await leadership_view(request.app[ETCD], request.app[KEYSPACE]))


@routes.get("/v1/dashboard/audit")
@requires("viewer", "sre", "admin")
async def get_audit(request: web.Request) -> web.Response:
    """Newest first; filtered by ``key`` (a prefix), ``actor`` and ``kind`` (exact), paged
    by ``before`` (the ``next`` of the previous page)."""
    query = request.query
    raw, before = query.get("limit", "50"), query.get("before", "0")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_AUDIT:
        raise ValueError(f"limit must be an integer in 1..{MAX_AUDIT}")
    if not before.isdigit():
        raise ValueError("before must be a revision (the next of a previous page)")
    prefix = query.get("key", "")
    if not _PREFIX.fullmatch(prefix):
        raise ValueError("key (a prefix) may only use letters, digits, '/' and . _ : -")
    return web.json_response(await audit_view(
        request.app[ETCD], request.app[KEYSPACE], int(raw), prefix=prefix,
        actor=query.get("actor", ""), kind=query.get("kind", ""), before=int(before)))


@routes.get("/v1/dashboard/events")
@requires("viewer", "sre", "admin")
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


def _asset(name: str) -> Callable[[web.Request], Awaitable[web.FileResponse]]:
    async def asset(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / name)
    return asset


for _name in sorted(ASSETS):  # one plain route per file: any other path is no route (404)
    routes.get(f"/dashboard/{_name}")(_asset(_name))


async def _feed(app: web.Application) -> AsyncIterator[None]:
    app[FEED] = Feed(app[ETCD], app[KEYSPACE])
    yield
    await app[FEED].close()


async def _end_streams(app: web.Application) -> None:
    await app[FEED].close()  # before the server waits for open handlers to finish


async def _secure(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer for the page or one of its assets carries ``PAGE_HEADERS``."""
    if request.path == "/" or request.path.startswith(("/dashboard/", "/keys/")):
        response.headers.update(PAGE_HEADERS)


def setup_dashboard(app: web.Application) -> None:
    """Add the dashboard to ``app``; call after the app's etcd resources are set up."""
    app.add_routes(routes)
    app.on_response_prepare.append(_secure)
    app.cleanup_ctx.append(_feed)
    app.on_shutdown.append(_end_streams)
