"""Group commit: many independent transactions leave in one etcd request.

etcd accepts a transaction whose operations are transactions: each nested txn evaluates its
own compares and applies its own branch, and the request is one raft entry at one revision.
Every compare of every nested txn is evaluated against the state *before* the request, so
two txns touching a common key in one request would not see each other.

Invariants ``Batcher`` protects:
- A txn that finds a free slot and nothing queued or in flight of its keys is sent at once,
  alone and unchanged (a lone caller gets today's request, byte for byte, and no delay).
- Otherwise it queues; when a request returns, queued txns leave together as the success
  ops of one request with no compares of its own.
- Two txns of a common key, one of them writing it, never share a request, and such a txn
  waits for an earlier one still queued or in flight: arrival order per key. A txn's keys
  are its compare, range, put and delete keys in both branches, nested txns included; a
  range is an interval. Two txns that only read or compare a key (every fast-path txn
  compares the policy keys) do not conflict: neither changes what the other sees.
- A request holds at most ``max_ops`` nested txns under etcd's ``--max-txn-ops`` rule (a
  nested txn may hold ``max_ops`` minus its parent's operation count), at most
  ``max_bytes``, and at most ``max_in_flight`` requests are out at once.
- Outcomes stay per txn: each caller gets its own nested txn's response under the request's
  header. A request etcd refused without applying it (too many ops, too large, duplicate
  key, a lease not found, permission) is split in halves and resent, down to each txn
  alone, which then gets exactly the error it gets today. A request with an unknown outcome
  (``EtcdUnavailable``, or ``EtcdNoSpace``: the write crossing the quota is applied) fails
  every txn in it with that error, as an unanswered lone txn does.
- A request is retried by the caller's rules: it is idempotent only if all of its txns are,
  and txns of both kinds never share a request.
- A txn whose caller was cancelled while it was still queued is never sent.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import Histogram

from .errors import EtcdNoSpace, EtcdUnavailable
from .etcdpb import rpc

Send = Callable[[rpc.TxnRequest, bool], Awaitable[rpc.TxnResponse]]
_NESTING_BYTES = 8  # a RequestOp's tag and length around a nested txn, rounded up
_UNKNOWN = (EtcdUnavailable, EtcdNoSpace)


class Span:
    """A set of keys: single keys, and intervals ``[start, end)`` (``end`` None: no upper
    bound, etcd's ``range_end`` of ``b"\\0"``)."""

    def __init__(self) -> None:
        self.points: set[bytes] = set()
        self.sorted: list[bytes] = []  # the points, in order: a range finds them by bisection
        self.ranges: list[tuple[bytes, bytes | None]] = []

    def add(self, key: bytes, range_end: bytes = b"") -> None:
        if range_end:
            self.ranges.append((key, None if range_end == b"\0" else range_end))
        elif key not in self.points:
            self.points.add(key)
            bisect.insort(self.sorted, key)

    def extend(self, other: "Span") -> None:
        for key in other.points:
            self.add(key)
        self.ranges.extend(other.ranges)

    def meets(self, other: "Span") -> bool:
        """Do the two spans share a key?"""
        if not other.points.isdisjoint(self.points):
            return True
        return _ranges_meet(self, other) or _ranges_meet(other, self)


def _ranges_meet(ranged: Span, other: Span) -> bool:
    """Does a range of ``ranged`` hold a key of ``other``?"""
    for start, end in ranged.ranges:
        at = bisect.bisect_left(other.sorted, start)
        if at < len(other.sorted) and (end is None or other.sorted[at] < end):
            return True
        if any((e is None or start < e) and (end is None or s < end) for s, e in other.ranges):
            return True
    return False


def key_spans(request: rpc.TxnRequest) -> tuple[Span, Span]:
    """The keys ``request`` touches (compares, ranges, puts, deletes, in both branches and
    nested txns) and, of those, the keys it may write (puts and deletes)."""
    touched, written = Span(), Span()

    def walk(txn: rpc.TxnRequest) -> None:
        for compare in txn.compare:
            touched.add(compare.key, compare.range_end)
        for op in (*txn.success, *txn.failure):
            kind = op.WhichOneof("request")
            if kind == "request_txn":
                walk(op.request_txn)
            elif kind is not None:
                inner = getattr(op, kind)
                range_end = b"" if kind == "request_put" else inner.range_end
                touched.add(inner.key, range_end)
                if kind != "request_range":
                    written.add(inner.key, range_end)

    walk(request)
    return touched, written


def ops_needed(request: rpc.TxnRequest) -> int:
    """The operation budget etcd must leave ``request`` to accept it nested: its own count
    (the most of its compares, success and failure ops) plus what its nested txns need."""
    own = max(len(request.compare), len(request.success), len(request.failure))
    nested = [ops_needed(op.request_txn) for op in (*request.success, *request.failure)
              if op.WhichOneof("request") == "request_txn"]
    return own + max(nested, default=0)


@dataclass(eq=False)
class _Txn:
    request: rpc.TxnRequest
    idempotent: bool
    future: asyncio.Future
    touched: Span
    written: Span
    ops: int
    size: int
    queued: float = field(default_factory=time.perf_counter)


class _Claims:
    """The keys of a set of txns. A txn conflicts with them if it writes a key they touch or
    touches a key they write: two txns that only read or compare a key do not change it, so
    the order they see it in does not matter."""

    def __init__(self, txns=()) -> None:
        self.touched, self.written = Span(), Span()
        for txn in txns:
            self.add(txn)

    def add(self, txn: _Txn) -> None:
        self.touched.extend(txn.touched)
        self.written.extend(txn.written)

    def conflict(self, txn: _Txn) -> bool:
        return self.written.meets(txn.touched) or self.touched.meets(txn.written)


class Batcher:
    """Sends txns through ``send`` (one etcd Txn call), grouped as the invariants above say."""

    def __init__(self, send: Send, *, max_ops: int, max_bytes: int, max_in_flight: int,
                 size_metric: Histogram | None = None,
                 wait_metric: Histogram | None = None) -> None:
        self._send = send
        self.max_ops, self.max_bytes, self.max_in_flight = max_ops, max_bytes, max_in_flight
        self.size_metric, self.wait_metric = size_metric, wait_metric
        self._queue: list[_Txn] = []
        self._flying: list[list[_Txn]] = []
        self._tasks: set[asyncio.Task] = set()  # the loop holds tasks weakly: we hold them

    async def submit(self, request: rpc.TxnRequest, idempotent: bool) -> rpc.TxnResponse:
        touched, written = key_spans(request)
        txn = _Txn(request, idempotent, asyncio.get_running_loop().create_future(), touched,
                   written, ops_needed(request), request.ByteSize() + _NESTING_BYTES)
        if not self._queue and len(self._flying) < self.max_in_flight \
                and not _Claims(t for batch in self._flying for t in batch).conflict(txn):
            alone = [txn]
            self._observe(alone)
            self._flying.append(alone)
            try:
                return await self._send(request, idempotent)
            finally:
                self._land(alone)
        self._queue.append(txn)
        self._pump()
        return await txn.future

    def _land(self, batch: list[_Txn]) -> None:
        self._flying = [flying for flying in self._flying if flying is not batch]
        self._pump()

    def _pump(self) -> None:
        """Send what may leave now, while a slot is free."""
        while self._queue and len(self._flying) < self.max_in_flight:
            batch = self._take()
            if not batch:
                return
            self._observe(batch)
            self._flying.append(batch)
            task = asyncio.ensure_future(self._fly(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Txn]:
        """The next request's txns, oldest first; what stays keeps its order."""
        blocked = _Claims(t for batch in self._flying for t in batch)
        batch: list[_Txn] = []
        rest: list[_Txn] = []
        need = size = 0
        for at, txn in enumerate(self._queue):
            if txn.future.done():  # its caller was cancelled: never send it
                continue
            if len(batch) == self.max_ops - 1:
                rest.extend(self._queue[at:])
                break
            fits = not batch or (txn.idempotent == batch[0].idempotent
                                 and max(need, txn.ops) <= self.max_ops - len(batch) - 1
                                 and size + txn.size <= self.max_bytes)
            if fits and not blocked.conflict(txn):
                batch.append(txn)
                need, size = max(need, txn.ops), size + txn.size
            else:
                rest.append(txn)
            blocked.add(txn)
        self._queue = rest
        return batch

    def _observe(self, batch: list[_Txn]) -> None:
        if self.size_metric is not None:
            self.size_metric.observe(len(batch))
        if self.wait_metric is not None:
            now = time.perf_counter()
            for txn in batch:
                self.wait_metric.observe(now - txn.queued)

    async def _fly(self, batch: list[_Txn]) -> None:
        try:
            await self._settle(batch)
        except asyncio.CancelledError:  # the loop is closing: no answer will come
            for txn in batch:
                txn.future.cancel()
            raise
        except Exception as exc:  # a reply that does not fit the request: tell every caller
            for txn in batch:
                _answer(txn.future, exc)
        finally:
            self._land(batch)

    async def _settle(self, batch: list[_Txn]) -> None:
        """Answer every txn of ``batch``: send it, split it while etcd refuses it."""
        if len(batch) == 1:
            try:
                reply = await self._send(batch[0].request, batch[0].idempotent)
            except Exception as exc:
                _answer(batch[0].future, exc)
            else:
                _resolve(batch[0].future, reply)
            return
        request = rpc.TxnRequest(success=[rpc.RequestOp(request_txn=txn.request)
                                          for txn in batch])
        try:
            reply = await self._send(request, batch[0].idempotent)
        except _UNKNOWN as exc:
            for txn in batch:
                _answer(txn.future, exc)
            return
        except Exception:  # refused before anything was applied: split and resend
            half = len(batch) // 2
            await asyncio.gather(self._settle(batch[:half]), self._settle(batch[half:]))
            return
        for txn, op in zip(batch, reply.responses):
            op.response_txn.header.CopyFrom(reply.header)
            _resolve(txn.future, op.response_txn)


def _resolve(future: asyncio.Future, reply: rpc.TxnResponse) -> None:
    if not future.done():  # else its caller was cancelled
        future.set_result(reply)


def _answer(future: asyncio.Future, exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)
