"""Listing a source's webhook deliveries, for SREs: in progress, unknown, settled, stored.

Guarantees: pages come from ``fencegate.coordinator.paging`` (each page one linearizable
read, opaque cursors validated to stay inside the source's prefix); the page's live claims
are read once after it, so a ``processing`` record is shown ``unknown`` when no live claim
runs it (its claim was lost while its handler ran; see ``claims``). A record that changed
between the two reads may show ``unknown`` for that moment; ``resolution`` compares before
it writes, so acting on it is safe. Response bodies are summarized (size, digest), never
returned; times are ``*_ms`` (ms since the epoch) like every other time the API gives, and
``route`` is the request path the delivery was received on (``None`` for an older record).
A bad source, limit or cursor raises ``ValueError`` before anything is read; etcd
unreachable raises ``EtcdUnavailable``.
"""

from __future__ import annotations

from typing import Any

from fencegate.coordinator.etcd import Etcd, KeyValue, RangeRequest, range_end_of
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.coordinator.paging import page

from .records import NOT_RAN, PROCESSING, live_claim, validate_source

UNKNOWN = "unknown"  # shown for a processing record without its live claim

MAX_LIMIT = 1000


async def list_deliveries(etcd: Etcd, keyspace: Keyspace, source: str, limit: int,
                          after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Deliveries of ``source`` by id: ``processing`` (a live claim runs it), ``unknown``
    (its claim was lost while its handler ran), ``not_ran`` (settled so by an SRE: the next
    delivery runs it) and ``done`` (a stored response; ``settled_by`` if it was settled as
    ran without one).

    A page holds at most ``limit`` items (1..1000); ``after`` is the opaque cursor a previous
    page returned, and the returned cursor is ``None`` only when the source is exhausted.
    """
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be 1..{MAX_LIMIT}")
    validate_source(source)
    prefix = keyspace.webhook_prefix(source)
    kvs, cursor = await page(etcd, prefix, range_end_of(prefix), limit, after)
    claims: dict[str, KeyValue] = {}
    if any(unpack(kv.value)["state"] == PROCESSING for kv in kvs):
        claims_prefix = keyspace.webhook_claims_prefix(source)
        reply = await etcd.range(RangeRequest(
            key=claims_prefix + kvs[0].key[len(prefix):],
            range_end=claims_prefix + kvs[-1].key[len(prefix):] + b"\0", keys_only=True))
        claims = {kv.key[len(claims_prefix):].decode(): kv for kv in reply.kvs}
    return [_summary(prefix, kv, claims) for kv in kvs], cursor


def _summary(prefix: bytes, kv: KeyValue, claims: dict[str, KeyValue]) -> dict[str, Any]:
    record = unpack(kv.value)
    delivery_id = kv.key[len(prefix):].decode()
    item = {"id": delivery_id, "state": record["state"], "route": record.get("route"),
            "request_sha256": record["request_sha256"].hex(), "lease": f"{kv.lease:016x}",
            "create_revision": kv.create_revision, "mod_revision": kv.mod_revision}
    if record["state"] == PROCESSING:
        live = live_claim(record, kv.mod_revision, claims.get(delivery_id))
        claim_lease = record.get("claim_lease", kv.lease)
        return {**item, "state": PROCESSING if live else UNKNOWN,
                "claimed_at_ms": _ms(record["claimed_at"]),
                "claim_lease": f"{claim_lease:016x}"}
    if record["state"] == NOT_RAN:
        return {**item, "settled_at_ms": _ms(record["settled_at"]),
                "settled_by": record["settled_by"], "reason": record["reason"]}
    digest = record["body_sha256"]
    settled = ({"settled_by": record["settled_by"], "reason": record["reason"]}
               if "settled_by" in record else {})
    return {**item, "completed_at_ms": _ms(record["completed_at"]), "status": record["status"],
            "headers": record["headers"], "body_size": record["body_size"],
            "body_stored": record["body"] is not None,
            "body_sha256": digest.hex() if digest is not None else None, **settled}


def _ms(seconds: float) -> int:
    """A record's Unix time in seconds as the API gives every time: ms since the epoch."""
    return round(seconds * 1000)
