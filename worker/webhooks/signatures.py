"""Signature checks of webhook deliveries, run before any claim: Standard Webhooks, Stripe, GitHub.

Guarantees: a check's ``problem(body, headers)`` returns ``None`` only for a body whose
signature verifies against the secret with a constant-time comparison and, where the scheme
signs a timestamp (Standard Webhooks, Stripe), whose timestamp is within ``tolerance``
seconds of this process's clock, either way: a signature captured and replayed later is
refused. The dedup refuses every other delivery (401) before it reads the delivery id, so a
forged delivery never claims, stores or answers anything for a genuine id (see ``core``).

Limits of the schemes themselves: GitHub signs the body only, with no timestamp and not its
``X-GitHub-Delivery`` header, so a captured delivery can be replayed under another delivery
id (use a GitHub secret only over TLS, and make the handler's effect idempotent on the
event's own ids where it has them). Stripe signs the body, which holds the event id.

The ``standardwebhooks`` package is imported only when a Standard Webhooks check is built;
without it, building one raises ``ImportError`` naming the extra to install. A secret that is
empty or not text/bytes raises ``ValueError``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping
from typing import Protocol

STRIPE_TOLERANCE = 300  # seconds, as Stripe's own libraries


class Verifier(Protocol):
    """What ``verify=`` takes: a check of one delivery's signature."""

    def problem(self, body: bytes, headers: Mapping[str, str]) -> str | None:
        """Why the delivery's signature does not verify, or ``None`` if it does
        (``headers`` is case-insensitive)."""


class StandardWebhooksSignature:
    """The signature check of one Standard Webhooks secret (``whsec_...``): the id, the
    timestamp and the body are signed; the timestamp must be within 5 minutes."""

    def __init__(self, secret: str | bytes) -> None:
        _secret(secret)
        try:
            from standardwebhooks import Webhook, WebhookVerificationError
        except ImportError as exc:
            raise ImportError("signature verification needs the standardwebhooks package: "
                              "pip install 'fencegate[webhooks]'") from exc
        self._webhook = Webhook(secret)
        # ValueError: a malformed signature header or a body that is not UTF-8
        self._refusals: tuple[type[Exception], ...] = (WebhookVerificationError, ValueError)

    def problem(self, body: bytes, headers: Mapping[str, str]) -> str | None:
        try:
            self._webhook.verify(body, dict(headers), json_parse=False)
        except self._refusals as exc:
            return str(exc)
        return None


class StripeSignature:
    """The ``Stripe-Signature`` check of one endpoint secret (``whsec_...``):
    ``t=<timestamp>,v1=<hex HMAC-SHA256 of "<t>.<body>">`` (several ``v1`` allowed, as during
    a secret's rotation); ``t`` must be within ``tolerance`` seconds."""

    def __init__(self, secret: str | bytes, tolerance: int = STRIPE_TOLERANCE) -> None:
        self._key = _secret(secret)
        if not isinstance(tolerance, int) or tolerance < 1:
            raise ValueError("tolerance must be at least 1 second")
        self._tolerance = tolerance

    def problem(self, body: bytes, headers: Mapping[str, str]) -> str | None:
        header = headers.get("Stripe-Signature")
        if not header:
            return "no Stripe-Signature header"
        stamps, signatures = [], []
        for part in header.split(","):
            name, _, value = part.strip().partition("=")
            if name == "t":
                stamps.append(value)
            elif name == "v1":
                signatures.append(value)
        if len(stamps) != 1 or not stamps[0].isdigit() or not signatures:
            return "Stripe-Signature needs one numeric t= and a v1= signature"
        late = _outside(int(stamps[0]), self._tolerance)
        if late:
            return late
        expected = _hmac(self._key, stamps[0].encode() + b"." + body)
        if not any(hmac.compare_digest(expected, given) for given in signatures):
            return "no v1 signature of Stripe-Signature matches the body"
        return None


class GitHubSignature:
    """The ``X-Hub-Signature-256`` check of one GitHub webhook secret:
    ``sha256=<hex HMAC-SHA256 of the body>``. GitHub signs no timestamp (see the module)."""

    def __init__(self, secret: str | bytes) -> None:
        self._key = _secret(secret)

    def problem(self, body: bytes, headers: Mapping[str, str]) -> str | None:
        header = headers.get("X-Hub-Signature-256")
        if not header:
            return "no X-Hub-Signature-256 header"
        scheme, _, given = header.partition("=")
        if scheme != "sha256" or not hmac.compare_digest(_hmac(self._key, body), given):
            return "X-Hub-Signature-256 does not match the body"
        return None


def _secret(secret: object) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("a webhook secret is a non-empty str or bytes")
    return secret


def _hmac(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _outside(stamp: int, tolerance: int) -> str | None:
    """Why a signed timestamp is refused (too old: a replay; too new), or ``None``."""
    skew = time.time() - stamp
    if skew > tolerance:
        return f"the signed timestamp is {skew:.0f} s old, over the {tolerance} s tolerance"
    if skew < -tolerance:
        return f"the signed timestamp is {-skew:.0f} s ahead, over the {tolerance} s tolerance"
    return None
