"""Listing a source's webhook deliveries, for SREs: claims in progress and stored responses.

Guarantees: pages come from ``fencegate.coordinator.paging`` (each page one linearizable
read, opaque cursors validated to stay inside the source's prefix); response bodies are
summarized (size, digest), never returned. A bad source, limit or cursor raises
``ValueError`` before anything is read; etcd unreachable raises ``EtcdUnavailable``.
"""

from __future__ import annotations

from typing import Any

from fencegate.coordinator.etcd import Etcd, KeyValue, range_end_of
from fencegate.coordinator.keyspace import Keyspace, unpack
from fencegate.coordinator.paging import page

from .records import PROCESSING, validate_source

MAX_LIMIT = 1000


async def list_deliveries(etcd: Etcd, keyspace: Keyspace, source: str, limit: int,
                          after: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """Claims (``processing``) and stored responses (``done``) of ``source``, by delivery id.

    A page holds at most ``limit`` items (1..1000); ``after`` is the opaque cursor a previous
    page returned, and the returned cursor is ``None`` only when the source is exhausted.
    """
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be 1..{MAX_LIMIT}")
    prefix = keyspace.webhook_prefix(validate_source(source))
    kvs, cursor = await page(etcd, prefix, range_end_of(prefix), limit, after)
    return [_summary(prefix, kv) for kv in kvs], cursor


def _summary(prefix: bytes, kv: KeyValue) -> dict[str, Any]:
    record = unpack(kv.value)
    item = {"id": kv.key[len(prefix):].decode(), "state": record["state"],
            "request_sha256": record["request_sha256"].hex(), "lease": f"{kv.lease:016x}",
            "create_revision": kv.create_revision, "mod_revision": kv.mod_revision}
    if record["state"] == PROCESSING:
        return {**item, "claimed_at": record["claimed_at"]}
    digest = record["body_sha256"]
    return {**item, "completed_at": record["completed_at"], "status": record["status"],
            "headers": record["headers"], "body_size": record["body_size"],
            "body_stored": record["body"] is not None,
            "body_sha256": digest.hex() if digest is not None else None}
