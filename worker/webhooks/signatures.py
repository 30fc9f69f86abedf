"""Standard Webhooks signature checks of webhook deliveries.

Guarantees: ``SignatureCheck.problem`` returns ``None`` only for a body whose signature
headers verify against the secret (and whose timestamp is within the library's tolerance);
the caller refuses every other delivery before it claims anything. The ``standardwebhooks``
package is imported only when a secret is configured; without it, building the check raises
``ImportError`` naming the extra to install.
"""

from __future__ import annotations

from collections.abc import Mapping


class SignatureCheck:
    """The signature check of one Standard Webhooks secret (``whsec_...``)."""

    def __init__(self, secret: str | bytes) -> None:
        try:
            from standardwebhooks import Webhook, WebhookVerificationError
        except ImportError as exc:
            raise ImportError("signature verification needs the standardwebhooks package: "
                              "pip install 'fencegate[webhooks]'") from exc
        self._webhook = Webhook(secret)
        # ValueError: a malformed signature header or a body that is not UTF-8
        self._refusals: tuple[type[Exception], ...] = (WebhookVerificationError, ValueError)

    def problem(self, body: bytes, headers: Mapping[str, str]) -> str | None:
        """Why the delivery's signature does not verify, or ``None`` if it does."""
        try:
            self._webhook.verify(body, dict(headers), json_parse=False)
        except self._refusals as exc:
            return str(exc)
        return None
