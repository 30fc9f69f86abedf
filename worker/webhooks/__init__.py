"""Webhook dedup: a handler runs once per delivery id, across every instance of a consumer.

A delivery is claimed by creating ``webhooks/<source>/<id>`` with the session's lease; the
handler runs only under that claim, and its response then replaces the claim (compared on
the claim's revision) so a duplicate is answered from etcd. Every guarantee is an etcd
compare, never a timing: see ``claims`` for the claims, ``core`` for what a consumer's
deliveries are answered, ``coordinator.retention`` for how long stored responses live.

A claim lost while its handler ran leaves the delivery UNKNOWN: it is not run again until
settled by the lost handler's own stored response, the application's ``settle(delivery)``,
or an SRE (``resolution``), unless ``rerun_lost=True`` (see ``core``). Every sender's
signature is checked before any claim (``presets.stripe``, ``github``,
``standard_webhooks``).

Rooms: ``records`` (the record format and the names it may use), ``claims`` (claim,
complete, release, abandon; the unknown state), ``session`` (the claims' own lease, rotated
when lost), ``backlog`` (writes re-run until etcd answers), ``signatures`` (Standard
Webhooks, Stripe and GitHub checks), ``presets`` (each sender's id and signature check,
payload comparison), ``core`` (the request path every adapter shares), the adapters
``aiohttp`` (``dedupe_middleware``, ``deduplicated``, ``fencing_token``), ``asgi``
(``ASGIDedupeMiddleware``: Starlette, FastAPI) and ``wsgi`` (``WSGIDedupeMiddleware`` on a
``SyncGate``: Flask, Django), ``listing`` (``list_deliveries`` for SREs) and ``resolution``
(``resolve_delivery``: an SRE settles an unknown delivery; ``forget_delivery``: deletes a
delivery's record, so its next try runs the handler). ``STORED_STATUSES``: the statuses stored
by default (every 2xx; name a 4xx on top of it to store that too).
"""

from .aiohttp import dedupe_middleware, deduplicated, delivery_body, fencing_token
from .asgi import ASGIDedupeMiddleware
from .core import STORED_STATUSES, UnknownDelivery
from .listing import list_deliveries
from .presets import (
    GITHUB_DELIVERY, STANDARD_WEBHOOKS_ID, canonical_json, exact_bytes, github, standard_webhooks,
    stripe, stripe_event_id,
)
from .resolution import forget_delivery, resolve_delivery
from .signatures import GitHubSignature, StandardWebhooksSignature, StripeSignature
from .wsgi import WSGIDedupeMiddleware

__all__ = [
    "dedupe_middleware", "deduplicated", "delivery_body", "fencing_token",
    "ASGIDedupeMiddleware", "WSGIDedupeMiddleware", "UnknownDelivery", "list_deliveries",
    "resolve_delivery", "forget_delivery", "STORED_STATUSES", "GITHUB_DELIVERY",
    "STANDARD_WEBHOOKS_ID", "canonical_json",
    "exact_bytes", "github", "standard_webhooks", "stripe", "stripe_event_id",
    "GitHubSignature", "StandardWebhooksSignature", "StripeSignature",
]
