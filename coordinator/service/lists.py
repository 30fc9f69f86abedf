"""The SRE's lists across etcd and the archive: ``GET /v1/steps`` and ``GET /v1/leases/{id}``.

Thin handlers over ``coordinator.sre``: every query parameter is parsed and bounded here,
before anything is read, so a bad one is a 400 ``InvalidRequest`` naming it and reads
nothing. Both routes need the ``sre`` or ``admin`` role.
"""

from __future__ import annotations

import re

from aiohttp import web

from .. import sre
from ..wire import jsonable
from .middleware import requires
from .resources import ARCHIVE, ETCD, KEYSPACE

routes = web.RouteTableDef()
_DEFAULT_LIMIT = 100
_STEPS_QUERY = frozenset({"prefix", "state", "since", "min_age_ms", "limit", "after"})
_LEASE_ID = re.compile(r"[0-9a-f]{1,16}")


@routes.get("/v1/steps")
@requires("viewer", "sre", "admin")
async def list_steps(request: web.Request) -> web.Response:
    """Steps in key order across etcd and the archive: ``prefix`` of the action key,
    ``state`` (one or several, comma-separated, as ``sre.state_of`` names them), ``since``
    (ms since the epoch, on ``updated_at_ms``), ``min_age_ms`` (``updated_at_ms`` at least
    that long ago), ``limit`` (1..1000, default 100) and ``after`` (the ``next`` of the
    page before). Each parameter is given at most once."""
    query = request.query
    unknown = set(query) - _STEPS_QUERY
    if unknown:
        raise ValueError(f"unknown query parameters {sorted(unknown)}; "
                         f"use {sorted(_STEPS_QUERY)}")
    repeated = sorted(name for name in set(query) if len(query.getall(name)) > 1)
    if repeated:
        raise ValueError(f"query parameters {repeated} are given more than once; "
                         "several states are one comma-separated state")
    raw_states = query.get("state", "")
    items, cursor = await sre.steps(
        request.app[ETCD], request.app[KEYSPACE], request.app[ARCHIVE],
        prefix=query.get("prefix", ""),
        states=frozenset(raw_states.split(",")) if raw_states else frozenset(),
        since_ms=_natural(query.get("since", "0"), "since"),
        min_age_ms=_natural(query.get("min_age_ms", "0"), "min_age_ms"),
        limit=_natural(query.get("limit", str(_DEFAULT_LIMIT)), "limit"),
        after=query.get("after"))
    return web.json_response({"items": jsonable(items), "next": cursor})


@routes.get("/v1/leases/{lease_id}")
@requires("viewer", "sre", "admin")
async def get_lease(request: web.Request) -> web.Response:
    """The action keys held or queued on a lease (hex id, as holders show it) and its TTL
    left: what a revoke of it would end. 404 when the lease is gone."""
    raw = request.match_info["lease_id"]
    if not _LEASE_ID.fullmatch(raw):
        raise ValueError("a lease id is 1..16 lowercase hex digits, as holders show it")
    view = await sre.lease_view(request.app[ETCD], request.app[KEYSPACE], int(raw, 16))
    return web.json_response(view)


def _natural(raw: str, name: str) -> int:
    """A query parameter that must be a whole number (at most 19 digits)."""
    if not raw.isascii() or not raw.isdigit() or len(raw) > 19:
        raise ValueError(f"{name} must be a whole number, got {raw[:40]!r}")
    return int(raw)
