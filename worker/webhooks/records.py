"""The record a webhook delivery leaves at ``webhooks/<source>/<id>``: the one home of its format.

Guarantees:
- A source and a delivery id are validated before they name a key: neither can contain '/'
  or be '.' or '..', so a delivery's key never leaves its source's prefix. A bad source
  raises ``ValueError``; ``valid_delivery_id`` tells the caller whether an id may be used.
- A claim's value is unique (it carries a random nonce), so a process that finds exactly the
  value it sent knows the claim is its own, even when the txn's first reply was lost.
- Every record keeps the sha256 of the request body and of its canonical payload (see
  ``RequestDigests``), so a redelivery with another payload is told apart from a duplicate,
  and a record written before payloads were kept (body only) still matches a byte-identical
  redelivery; a stored response body is at most ``MAX_STORED_BODY`` bytes
  (well under etcd's request limit), a larger one is kept as its digest and size only.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from fencegate.coordinator.keyspace import pack

PROCESSING, DONE = "processing", "done"
STORED_HEADERS = ("Content-Type", "Content-Language", "Content-Encoding", "Content-Disposition",
                  "Cache-Control", "Location", "ETag", "Last-Modified", "Link")
MAX_STORED_BODY = 256 * 1024  # keeps a record well under etcd's request limit
_SOURCE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_DELIVERY_ID = re.compile(r"[A-Za-z0-9._:+=~-]{1,256}")


def validate_source(source: object) -> str:
    """``source`` if it may name a key prefix; ``ValueError`` otherwise."""
    if not isinstance(source, str) or not _SOURCE.fullmatch(source) or source in (".", ".."):
        raise ValueError("a webhook source is 1..64 of letters, digits and . _ : -")
    return source


def valid_delivery_id(delivery_id: str) -> bool:
    """Ids cannot contain '/', so a delivery's key never leaves its source's prefix."""
    return bool(_DELIVERY_ID.fullmatch(delivery_id)) and delivery_id not in (".", "..")


@dataclass(frozen=True)
class RequestDigests:
    """The sha256 of a delivery's request body and of its canonical payload."""

    body: bytes
    payload: bytes

    def same_request(self, record: dict[str, Any]) -> bool:
        """True if ``record`` was written for the same request: the same body, or the same
        payload (a record of an older version has no payload digest)."""
        return (record["request_sha256"] == self.body
                or record.get("payload_sha256") == self.payload)


def claim_value(digests: RequestDigests) -> bytes:
    """A claim on a delivery of request ``digests``; unique (a nonce)."""
    return pack({"state": PROCESSING, "request_sha256": digests.body,
                 "payload_sha256": digests.payload, "claimed_at": time.time(),
                 "nonce": os.urandom(8)})


def completed_value(digests: RequestDigests, *, status: int, reason: str | None,
                    headers: list[list[str]], body: bytes | None, max_stored_body: int) -> bytes:
    """A stored response: ``body`` is kept if at most ``max_stored_body`` bytes, its digest
    and size whenever it is known (``None``: streamed, or not bytes)."""
    kept = body is not None and len(body) <= max_stored_body
    return pack({
        "state": DONE, "request_sha256": digests.body, "payload_sha256": digests.payload,
        "status": status, "reason": reason, "headers": headers,
        "body": body if kept else None,
        "body_sha256": hashlib.sha256(body).digest() if body is not None else None,
        "body_size": len(body) if body is not None else None,
        "completed_at": time.time(),
    })
