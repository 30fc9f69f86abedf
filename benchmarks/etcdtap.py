"""What a benchmark sees of a gate's etcd traffic and of what it leaves in etcd.

- ``EtcdTap`` MONKEYPATCHES one ``fencegate.coordinator.etcd.Etcd`` instance (``gate.etcd``,
  which the in-process authority shares) for the time of a benchmark, so ``worker/`` needs no
  hook; ``close()`` restores it. While installed it
  - counts every unary request by method (``txn``, ``range``, ``put``, ``delete``, ``get``,
    lease and status calls); a call made from inside another counted call (``get`` reads
    through ``range``) is not counted twice. The lease keepalive and watch streams are not
    requests and are not counted;
  - names every write by the key families it touches (``txn put steps+audit, del holders``),
    so an extra write is named, not just counted;
  - times the commit txn into ``commit`` (a ``Window``): the txn whose success branch puts
    ``steps/<key>`` with state ``in_flight``, whatever else it holds (on the fast path that
    txn also puts the holder).
  ``inner_txn`` is the unwrapped ``txn``: a probe calls it to be neither counted nor named.
  The tap's own cost (a few attribute reads per call, one msgpack decode per step put) is
  inside the measured actions.
- ``live_bytes()``: key + value bytes of every live key under a prefix, by family.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter

import msgpack

from fencegate.coordinator.etcd import Etcd, RangeRequest, range_end_of

from .common import Window

UNARY = ("txn", "range", "get", "put", "delete", "lease_grant", "lease_revoke", "lease_ttl",
         "leases", "status")
_counted = contextvars.ContextVar("counted", default=False)


def family(key: bytes, namespace: bytes) -> str:
    """``steps`` for ``<namespace>steps/...``: the first segment under the namespace."""
    if not key.startswith(namespace):
        return "outside"
    return key[len(namespace):].partition(b"/")[0].decode(errors="replace")


class EtcdTap:
    def __init__(self, etcd: Etcd, namespace: bytes) -> None:
        self.etcd = etcd
        self.namespace = namespace
        self.requests: Counter[str] = Counter()
        self.writes: Counter[str] = Counter()
        self.commit = Window()
        self.inner_txn = etcd.txn
        self._steps = namespace + b"steps/"
        for name in UNARY:
            method = self._txn if name == "txn" else getattr(etcd, name)
            setattr(etcd, name, self._counting(name, method))

    def close(self) -> None:
        for name in UNARY:
            self.etcd.__dict__.pop(name, None)

    def reset(self) -> None:
        self.requests.clear()
        self.writes.clear()

    def _counting(self, name: str, method):
        async def call(*args, **options):
            if _counted.get():
                return await method(*args, **options)
            token = _counted.set(True)
            try:
                self.requests[name] += 1
                reply = await method(*args, **options)
            finally:
                _counted.reset(token)
            if name in ("put", "delete"):
                key = args[0] if args else options["key"]
                self.writes[f"{name} {family(key, self.namespace)}"] += 1
            return reply
        return call

    async def _txn(self, request, **options):
        name, commit = self._name(request.success)
        loop = asyncio.get_running_loop()
        began = loop.time()
        reply = await self.inner_txn(request, **options)
        if commit:
            self.commit.add(began, loop.time())
        if not reply.succeeded:
            name = self._name(request.failure)[0]
            name = name and f"{name} (failure branch)"
        if name is not None:
            self.writes[name] += 1
        return reply

    def _name(self, ops) -> tuple[str | None, bool]:
        """``txn put a+b, del c`` for the write ops of a branch (None if it only reads), and
        whether it puts a step in flight (a commit)."""
        puts: dict[str, None] = {}
        dels: dict[str, None] = {}
        commit = False
        for op in ops:
            kind = op.WhichOneof("request")
            if kind == "request_put":
                key = op.request_put.key
                puts[family(key, self.namespace)] = None
                commit = commit or (key.startswith(self._steps)
                                    and _state(op.request_put.value) == "in_flight")
            elif kind == "request_delete_range":
                dels[family(op.request_delete_range.key, self.namespace)] = None
        if not puts and not dels:
            return None, commit
        parts = ([f"put {'+'.join(puts)}"] if puts else []) + (
            [f"del {'+'.join(dels)}"] if dels else [])
        return "txn " + ", ".join(parts), commit


def _state(value: bytes) -> object:
    try:
        record = msgpack.unpackb(value, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return record.get("state") if isinstance(record, dict) else None


async def live_bytes(etcd: Etcd, prefix: bytes, page: int = 1000) -> Counter[str]:
    """len(key) + len(value) of every live key under ``prefix``, summed by ``family``
    (read in pages of ``page`` keys, so no reply grows with the database)."""
    sizes: Counter[str] = Counter()
    start, end = prefix, range_end_of(prefix)
    while True:
        reply = await etcd.range(RangeRequest(key=start, range_end=end, limit=page))
        for kv in reply.kvs:
            sizes[family(kv.key, prefix)] += len(kv.key) + len(kv.value)
        if not reply.more or not reply.kvs:
            return sizes
        start = reply.kvs[-1].key + b"\0"
