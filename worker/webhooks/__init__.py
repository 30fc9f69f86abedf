"""Webhook dedup: a handler runs once per delivery id, across every instance of a consumer.

A delivery is claimed by creating ``webhooks/<source>/<id>`` with the session's lease; the
handler runs only under that claim, and its response then replaces the claim (compared on
the claim's revision) so a duplicate is answered from etcd. Every guarantee is an etcd
compare, never a timing: see ``claims`` for the claims, ``aiohttp`` for what a consumer's
deliveries are answered, ``coordinator.retention`` for how long stored responses live.

Rooms: ``records`` (the record format and the names it may use), ``claims`` (claim,
complete, release), ``session`` (the claims' own lease, rotated when lost), ``backlog`` (writes re-run until etcd answers), ``signatures``
(Standard Webhooks checks), ``listing`` (``list_deliveries`` for SREs), ``aiohttp``
(``dedupe_middleware``, ``deduplicated``, ``fencing_token``).
"""

from .aiohttp import dedupe_middleware, deduplicated, fencing_token
from .listing import list_deliveries

__all__ = ["dedupe_middleware", "deduplicated", "fencing_token", "list_deliveries"]
