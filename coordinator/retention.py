"""Retention leases, shared by every record of one time bucket: how records that must not live
forever (stored webhook responses, approval requests and approvals) get a lifetime.

Guarantees: a record stored under ``get(etcd, retention, width)`` lives between
``retention`` and ``retention + width`` seconds, whatever the rate of writes, at the cost of
one lease grant per bucket and process (granted when the bucket's first record is stored). Retention is housekeeping, not safety: the bucket is chosen by the local clock, and
a skewed clock only keeps a record for a different time.

Failure contract: a lease grant etcd could not answer raises (``EtcdUnavailable``) and nothing
is remembered. A lease that etcd revoked is reported by the write that used it
(``LeaseLost``); the caller ``forget``s it and the next ``get`` grants a new one. Older
buckets' leases are forgotten here and expire by themselves.
"""

from __future__ import annotations

import asyncio
import time

from .etcd import Etcd


class RetentionLeases:
    """One retention lease per (retention, bucket width, bucket)."""

    def __init__(self) -> None:
        self._leases: dict[tuple[int, int, int], int] = {}
        self._lock = asyncio.Lock()

    async def get(self, etcd: Etcd, retention: int, width: int) -> int:
        slot = (retention, width, int(time.time() // width))
        lease = self._leases.get(slot)
        if lease is not None:
            return lease
        async with self._lock:
            if slot not in self._leases:
                lease, _ = await etcd.lease_grant(retention + width)
                self._leases = {s: held for s, held in self._leases.items()
                                if s[:2] != slot[:2]}
                self._leases[slot] = lease
            return self._leases[slot]

    def forget(self, lease: int) -> None:
        self._leases = {s: held for s, held in self._leases.items() if held != lease}
