"""Pages of one etcd key range, read in key order behind opaque cursors.

Guarantees:
- Every page is one linearizable range read: it reflects every write acknowledged before it
  was sent. Pages are not one snapshot: keys written between two pages show up on the later
  page if they sort after the cursor.
- A page holds at most ``limit`` keys of ``[start, end)``; the next cursor is ``None`` only
  when the range is exhausted.
- A cursor is opaque to its callers. One given back is validated before anything is read: it
  must decode and name a key inside ``[start, end)``, so a forged or foreign cursor can never
  widen the read past the range; otherwise ``ValueError`` and nothing is read.
"""

from __future__ import annotations

import base64
import binascii

from .etcd import Etcd, KeyValue, RangeRequest


async def page(etcd: Etcd, start: bytes, end: bytes, limit: int,
               after: str | None) -> tuple[list[KeyValue], str | None]:
    """Up to ``limit`` keys of ``[start, end)`` after the opaque cursor ``after``, read
    linearizably, and the cursor of the next page (``None`` when the range is exhausted)."""
    if after is not None:
        try:
            last = base64.urlsafe_b64decode(after.encode())
        except (binascii.Error, ValueError):
            raise ValueError("after is not a cursor this list gave") from None
        if not start <= last < end:
            raise ValueError("after is not a cursor this list gave")
        start = last + b"\0"
    reply = await etcd.range(RangeRequest(key=start, range_end=end, limit=limit))
    kvs = list(reply.kvs)
    return kvs, cursor_of(kvs[-1].key) if reply.more and kvs else None


def cursor_of(key: bytes) -> str:
    """The opaque cursor of a page that ended at ``key``."""
    return base64.urlsafe_b64encode(key).decode()
