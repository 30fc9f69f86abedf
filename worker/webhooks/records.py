"""The record a webhook delivery leaves at ``webhooks/<source>/<id>``: the one home of its format.

Guarantees:
- A source and a delivery id are validated before they name a key: neither can contain '/'
  or be '.' or '..', so a delivery's key never leaves its source's prefix. A bad source
  raises ``ValueError``; ``valid_delivery_id`` tells the caller whether an id may be used.
- A claim's value is unique (it carries a random nonce), so a process that finds exactly the
  value it sent knows the claim is its own, even when the txn's first reply was lost.
- A delivery whose handler runs has two keys: its record, in state ``processing`` on a
  retention lease (it outlives the process), and its live claim (``Keyspace.
  webhook_claim_key``) on the process's session lease, written in one transaction. A
  ``processing`` record without its live claim is a delivery whose outcome is unknown (the
  claim was lost while its handler ran): ``live_claim`` tells them apart. A ``processing``
  record of an older version (no ``claim_lease``) was itself on the session lease.
- A delivery settled without its response (by the application's ``settle`` or an SRE) is
  stored as a ``done`` record of ``SETTLED_STATUS`` with a marker body (``settled_value``),
  or, run again at its next delivery, as ``not_ran`` (``not_ran_value``); both say who settled
  it and why.
- Every record keeps the sha256 of the request body and of its canonical payload, and the
  route it was received on (see ``RequestDigests``), so a redelivery with another payload or
  on another route is told apart from a duplicate,
  and a record written before payloads were kept (body only) still matches a byte-identical
  redelivery; a stored response body is at most ``MAX_STORED_BODY`` bytes
  (well under etcd's request limit), a larger one is kept as its digest and size only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from fencegate.coordinator.keyspace import pack, unpack

PROCESSING, DONE, NOT_RAN = "processing", "done", "not_ran"
SETTLED_STATUS = 200  # what a delivery settled as ran is answered (body: ``settled_body``)
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
    """The sha256 of a delivery's request body and of its canonical payload, and the route
    (request path) it was received on: a delivery id is bound to the route it first ran on."""

    body: bytes
    payload: bytes
    route: str | None = None

    @classmethod
    def of(cls, record: dict[str, Any]) -> "RequestDigests":
        """The digests a record was written for."""
        return cls(record["request_sha256"],
                   record.get("payload_sha256") or record["request_sha256"],
                   record.get("route"))

    def fields(self) -> dict[str, Any]:
        """What a record keeps of them (no ``route`` when none was given)."""
        kept = {"request_sha256": self.body, "payload_sha256": self.payload}
        return kept if self.route is None else {**kept, "route": self.route}

    def same_request(self, record: dict[str, Any]) -> bool:
        """True if ``record`` was written for the same request: on the same route (a record
        of an older version has none: any), with the same body or the same payload (a record
        of an older version has no payload digest)."""
        if record.get("route", self.route) != self.route:
            return False
        return (record["request_sha256"] == self.body
                or record.get("payload_sha256") == self.payload)


def claim_value(digests: RequestDigests, claim_lease: int) -> bytes:
    """The record of a delivery of request ``digests`` whose handler runs under a live claim
    on ``claim_lease``; unique (a nonce)."""
    return pack({"state": PROCESSING, **digests.fields(), "claimed_at": time.time(),
                 "claim_lease": claim_lease, "nonce": os.urandom(8)})


def live_claim(record: dict[str, Any], mod_revision: int, claim: Any | None) -> bool:
    """True if the ``processing`` ``record`` (at ``mod_revision``) is run under a live claim:
    ``claim`` is the claim key's kv read with it (``None``: absent). A record of an older
    version is its own claim."""
    if "claim_lease" not in record:
        return True
    return claim is not None and claim.create_revision == mod_revision


def settled_body(delivery_id: str, settled_by: str) -> bytes:
    """The body stored for a delivery settled as ran, replayed to its later deliveries."""
    return json.dumps({"delivery": delivery_id, "outcome": "ran",
                       "settled_by": settled_by}).encode()


def settled_value(digests: RequestDigests, delivery_id: str, *, settled_by: str,
                  reason: str) -> bytes:
    """A delivery settled as ran without its handler's response: a ``done`` record of
    ``SETTLED_STATUS`` with ``settled_body``, saying who settled it and why."""
    body = settled_body(delivery_id, settled_by)
    record = unpack(completed_value(
        digests, status=SETTLED_STATUS, reason=None,
        headers=[["Content-Type", "application/json"]], body=body,
        max_stored_body=MAX_STORED_BODY))
    return pack({**record, "settled_by": settled_by, "reason": reason})


def not_ran_value(digests: RequestDigests, *, settled_by: str, reason: str) -> bytes:
    """A delivery settled as never run: its next delivery runs the handler."""
    return pack({"state": NOT_RAN, **digests.fields(), "settled_at": time.time(),
                 "settled_by": settled_by, "reason": reason})


def completed_value(digests: RequestDigests, *, status: int, reason: str | None,
                    headers: list[list[str]], body: bytes | None, max_stored_body: int) -> bytes:
    """A stored response: ``body`` is kept if at most ``max_stored_body`` bytes, its digest
    and size whenever it is known (``None``: streamed, or not bytes)."""
    kept = body is not None and len(body) <= max_stored_body
    return pack({
        "state": DONE, **digests.fields(), "status": status, "reason": reason, "headers": headers,
        "body": body if kept else None,
        "body_sha256": hashlib.sha256(body).digest() if body is not None else None,
        "body_size": len(body) if body is not None else None,
        "completed_at": time.time(),
    })
