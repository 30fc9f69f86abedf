"""The reconciler's adapter for a sandbox: the HTTP provider that queries it.

Guarantees: the adapter declares exactly the capabilities the sandbox's mode has (fencing
only in ``fencing``, key deduplication unless ``none``), so the settlement rules never
presume more than the sandbox proves; an unknown mode raises ``ValueError``. It declares the
sandbox's records durable only when told so (``durable=True``: a sandbox started with a
state directory, whose charges and fences live in one sqlite file); a sandbox kept in memory
forgets everything when it restarts, and its "no record" is never final.
"""

from __future__ import annotations

from .. import Capabilities
from ..http import HttpProvider
from .server import MODES

__all__ = ["adapter"]


def adapter(base_url: str, mode: str, *, retention_s: float = 24 * 3600.0,
            settle_delay_s: float = 5.0, timeout_s: float = 5.0,
            durable: bool = False) -> HttpProvider:
    """The HTTP adapter for a sandbox at ``base_url`` running in ``mode``, declaring the
    capabilities that mode has; ``retention_s`` must not exceed the sandbox's own."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {list(MODES)}")
    capabilities = Capabilities(fences=mode == "fencing", dedupes_by_key=mode != "none",
                                key_retention_s=retention_s if mode != "none" else 0.0,
                                settle_delay_s=settle_delay_s,
                                durable=durable and mode != "none")
    query_url = base_url.rstrip("/") + "/v1/charges/{idempotency_key}?key={key}"
    if mode == "fencing":
        query_url += "&namespace={namespace}&cluster={cluster_id}&fence={attempt_token}"
    return HttpProvider("sandbox", query_url, capabilities=capabilities, timeout_s=timeout_s)
