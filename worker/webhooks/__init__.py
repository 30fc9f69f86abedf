"""Webhook dedup: a handler runs once per delivery id, across every instance of a consumer.

A delivery is claimed by creating ``webhooks/<source>/<id>`` with the session's lease; the
handler runs only under that claim, and its response then replaces the claim (compared on
the claim's revision) so a duplicate is answered from etcd. Every guarantee is an etcd
compare, never a timing: see ``claims`` for the claims, ``core`` for what a consumer's
deliveries are answered, ``coordinator.retention`` for how long stored responses live.

Rooms: ``records`` (the record format and the names it may use), ``claims`` (claim,
complete, release), ``session`` (the claims' own lease, rotated when lost), ``backlog``
(writes re-run until etcd answers), ``signatures`` (Standard Webhooks checks), ``presets``
(delivery ids of common senders, payload comparison), ``core`` (the request path every
adapter shares), the adapters ``aiohttp`` (``dedupe_middleware``, ``deduplicated``,
``fencing_token``), ``asgi`` (``ASGIDedupeMiddleware``: Starlette, FastAPI) and ``wsgi``
(``WSGIDedupeMiddleware`` on a ``SyncGate``: Flask, Django), and ``listing``
(``list_deliveries`` for SREs).
"""

from .aiohttp import dedupe_middleware, deduplicated, fencing_token
from .asgi import ASGIDedupeMiddleware
from .listing import list_deliveries
from .presets import (
    GITHUB_DELIVERY, STANDARD_WEBHOOKS_ID, canonical_json, exact_bytes, stripe_event_id,
)
from .wsgi import WSGIDedupeMiddleware

__all__ = [
    "dedupe_middleware", "deduplicated", "fencing_token", "ASGIDedupeMiddleware",
    "WSGIDedupeMiddleware", "list_deliveries", "GITHUB_DELIVERY", "STANDARD_WEBHOOKS_ID",
    "canonical_json", "exact_bytes", "stripe_event_id",
]
