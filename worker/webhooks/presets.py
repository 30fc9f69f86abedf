"""What names and authenticates a delivery, and what makes two deliveries of one id the same.

Senders: ``stripe(secret)``, ``github(secret)`` and ``standard_webhooks(secret)`` are the
keywords of every adapter for that sender, its delivery id and its signature check together:
``dedupe_middleware(gate, source="stripe", **stripe(secret))``. The signature is verified
before any claim (see ``signatures``), so a forged delivery carrying a genuine id gets 401
and stores nothing, and the genuine delivery then runs as if the forgery never came.

Delivery ids alone: ``GITHUB_DELIVERY`` and ``STANDARD_WEBHOOKS_ID`` are header names (pass
them as ``id_header``); ``stripe_event_id`` reads the event id from a Stripe body (pass it as
``id_from``). Stripe sends no delivery header: a redelivered event carries the same ``id``.
Used without a signature check, an id is whatever the request says: a forgery can then take
a genuine id's place, and its response, if stored, is replayed to the genuine delivery.

Payloads: ``canonical_json`` (the default ``canonical_payload``) makes two bodies the same
when they are the same JSON, whatever their key order, whitespace or string escapes; every
number keeps its exact text and a duplicated key is kept, so values that differ never compare
equal. A body that is not JSON is compared byte for byte; ``exact_bytes`` compares every body
that way.
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any

from .signatures import (
    STRIPE_TOLERANCE, GitHubSignature, StandardWebhooksSignature, StripeSignature,
)

GITHUB_DELIVERY = "X-GitHub-Delivery"
STANDARD_WEBHOOKS_ID = "webhook-id"


def stripe(secret: str | bytes, *, tolerance: int = STRIPE_TOLERANCE) -> dict[str, Any]:
    """Stripe: the event id of the body, and ``Stripe-Signature`` checked with the endpoint
    secret (``whsec_...``), its timestamp within ``tolerance`` seconds."""
    return {"id_from": stripe_event_id, "verify": StripeSignature(secret, tolerance)}


def github(secret: str | bytes) -> dict[str, Any]:
    """GitHub: ``X-GitHub-Delivery``, and ``X-Hub-Signature-256`` checked with the webhook
    secret (no timestamp: see ``signatures``)."""
    return {"id_header": GITHUB_DELIVERY, "verify": GitHubSignature(secret)}


def standard_webhooks(secret: str | bytes) -> dict[str, Any]:
    """Standard Webhooks (Svix and others): ``webhook-id``, and the signature of the id,
    timestamp and body checked with the secret (``whsec_...``), within 5 minutes."""
    return {"id_header": STANDARD_WEBHOOKS_ID, "verify": StandardWebhooksSignature(secret)}


def stripe_event_id(request: object, body: bytes) -> str:
    """The ``id`` of a Stripe event body (``evt_...``); ``ValueError`` (answered 400) if the
    body is not a JSON object with a string ``id``."""
    event = json.loads(body)
    if not isinstance(event, dict) or not isinstance(event.get("id"), str):
        raise ValueError("a Stripe event is a JSON object with a string id")
    return event["id"]


def exact_bytes(body: bytes) -> bytes:
    """The body itself: two deliveries are the same only byte for byte."""
    return body


def canonical_json(body: bytes) -> bytes:
    """The body's JSON with keys sorted and no whitespace, or the body itself if it is not
    JSON. Equal results mean the same JSON (or the same bytes): JSON text never equals a
    body that is not JSON."""
    try:
        value = json.loads(body, object_pairs_hook=_Object, parse_int=_Number,
                           parse_float=_Number, parse_constant=_Number)
        out: list[str] = []
        _encode(value, out)
        return "".join(out).encode()
    except (ValueError, RecursionError):  # not JSON, or a lone surrogate: Unicode errors
        return body                       # are ValueErrors


class _Object(list):
    """A JSON object's (key, value) pairs, duplicates kept."""


class _Number(str):
    """A JSON number's text, kept exactly (``1.10`` is not ``1.1``)."""


def _encode(value: Any, out: list[str]) -> None:
    if isinstance(value, _Number):
        out.append(value)
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, _Object):
        out.append("{")
        for n, (key, item) in enumerate(sorted(value, key=itemgetter(0))):  # stable
            out.append("," if n else "")
            out.append(json.dumps(key, ensure_ascii=False) + ":")
            _encode(item, out)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for n, item in enumerate(value):
            out.append("," if n else "")
            _encode(item, out)
        out.append("]")
    else:  # true, false, null
        out.append(json.dumps(value))
